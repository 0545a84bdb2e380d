"""Rotary position embedding (RoPE) at explicit positions, matching HF transformers' rotate-half form.

Settings come from the HF config: transformers >= 5 keeps them in `config.rope_parameters`
({"rope_type", "rope_theta", ...}); older configs keep `config.rope_theta` and an optional
`config.rope_scaling` dict (type under "rope_type" or "type"). Supported: "default", "linear", and
"llama3" (the Llama 3.1 frequency smoothing). Anything else is refused when the model is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fitserve.layers.cpu.c_kernels.library import load_cpu_kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_ROPE_THETA = 10_000.0


@dataclass(frozen=True)
class RopeSettings:
    rope_type: str = "default"
    theta: float = DEFAULT_ROPE_THETA
    factor: float = 1.0  # linear and llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3: the pre-training context length


def _rope_dict(config: Any) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        return dict(params)
    legacy = getattr(config, "rope_scaling", None)
    return dict(legacy) if isinstance(legacy, dict) else {}


def rope_settings_from_config(config: Any) -> RopeSettings:
    """Reads the RoPE settings from either config generation; raises ValueError for an unsupported one."""
    params = _rope_dict(config)
    if params and all(isinstance(value, dict) for value in params.values()):
        raise ValueError(
            f"per-layer-type rope parameters ({sorted(params)}) are not supported: "
            "fitserve runs models with one RoPE setting for every layer"
        )
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None) or DEFAULT_ROPE_THETA
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(
            f"partial_rotary_factor={partial} is not supported for this architecture: it must be 1.0"
        )
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type={rope_type!r} is not supported: use a model whose rope type is one of "
            f"{list(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeSettings(theta=float(theta))
    if "factor" not in params:
        raise ValueError(f"rope_type={rope_type!r} needs a 'factor' in the config's rope settings")
    if rope_type == "linear":
        return RopeSettings(rope_type="linear", theta=float(theta), factor=float(params["factor"]))
    original = params.get("original_max_position_embeddings") or getattr(
        config, "max_position_embeddings", None
    )
    if original is None:
        raise ValueError("rope_type='llama3' needs original_max_position_embeddings in the config")
    return RopeSettings(
        rope_type="llama3",
        theta=float(theta),
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
    )


def compute_inv_freq(rotary_dim: int, settings: RopeSettings) -> torch.Tensor:
    """float32 [rotary_dim // 2]: the angle per position of each rotated pair of dimensions."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (settings.theta**exponents)
    if settings.rope_type == "linear":
        return inv_freq / settings.factor
    if settings.rope_type == "llama3":
        return _llama3_smoothing(inv_freq, settings)
    return inv_freq


def _llama3_smoothing(inv_freq: torch.Tensor, settings: RopeSettings) -> torch.Tensor:
    """Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated."""
    old_len = settings.original_max_position_embeddings
    long_wavelen = old_len / settings.low_freq_factor  # longer than this: divide by factor
    short_wavelen = old_len / settings.high_freq_factor  # shorter than this: keep
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > long_wavelen, inv_freq / settings.factor, inv_freq)
    smooth = (old_len / wavelen - settings.low_freq_factor) / (
        settings.high_freq_factor - settings.low_freq_factor
    )
    interpolated = (1 - smooth) * scaled / settings.factor + smooth * scaled
    in_band = (wavelen >= short_wavelen) & (wavelen <= long_wavelen)
    return torch.where(in_band, interpolated, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for a step's positions; `apply_rotary_emb` rotates q or k with them.

    The angles are computed in float32 from explicit positions (no position limit, no cached table), then
    cast to the activations' dtype, as HF transformers does.
    """

    def __init__(self, head_dim: int, settings: RopeSettings, max_positions: int = 8192) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.settings = settings
        self.register_buffer(
            "inv_freq", compute_inv_freq(head_dim, settings).to(torch.float32), persistent=False
        )

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int [T] -> (cos, sin), each [T, head_dim] in `dtype`."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq.to(torch.float32)[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def rope_for_step(
        self, positions: torch.Tensor, dtype: torch.dtype, table_dtype: torch.dtype = torch.float32
    ) -> StepRope:
        """What a decoder layer applies to q and k this step: a fused in-place kernel over a cached
        cos/sin table on CUDA (in table_dtype: Gemma-4 takes the model dtype, as HF rounds its cos and
        sin, at half the memory of a 262k-position float32 table), the torch reference elsewhere."""
        if positions.is_cuda:
            if table_dtype != torch.float32:
                table = self.cos_sin_table(positions.device, table_dtype)
                return StepRope(positions=positions, cos_sin_cache=table)
            return StepRope(positions=positions, cos_sin_cache=self._cos_sin_cache(positions.device))
        cos, sin = self(positions, dtype)
        half = self.head_dim // 2
        # rotate_half(x) * sin == roll(x, half) * [-sin_first_half | sin_second_half], bit for bit
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return StepRope(cos=cos.unsqueeze(1), sin=signed_sin.unsqueeze(1))

    def _cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        """float32 [max_positions, head_dim]: cos of each angle pair, then sin (the kernel's layout)."""
        cache = getattr(self, "_cached_cos_sin", None)
        if cache is None or cache.device != device:
            positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
            angles = positions[:, None] * self.inv_freq.to(device=device, dtype=torch.float32)[None, :]
            cache = torch.cat((angles.cos(), angles.sin()), dim=-1).contiguous()
            self._cached_cos_sin = cache
        return cache

    def cos_sin_table(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """[max_positions, head_dim] in `dtype`, built once per device and dtype: cos of each angle
        pair, then sin, each computed in float32 and rounded once. Built in slices of positions, so a
        long table costs no float32 copy of itself on the way."""
        tables = self.__dict__.setdefault("_cos_sin_tables", {})
        key = (device, dtype)
        if key not in tables:
            half = self.head_dim // 2
            table = torch.empty((self.max_positions, 2 * half), dtype=dtype, device=device)
            inv_freq = self.inv_freq.to(device=device, dtype=torch.float32)
            step = 16384
            for start in range(0, self.max_positions, step):
                stop = min(start + step, self.max_positions)
                positions = torch.arange(start, stop, dtype=torch.float32, device=device)
                angles = positions[:, None] * inv_freq[None, :]
                table[start:stop, :half] = angles.cos()
                table[start:stop, half:] = angles.sin()
            tables[key] = table
        return tables[key]

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, {self.settings}"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, num_heads, head_dim]; cos, sin: [T, head_dim]."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


@dataclass
class StepRope:
    """One step's rotary inputs: (positions, cos_sin_cache) for the CUDA kernel, or, elsewhere, tables
    `cos` [T, 1, D] and `sin` [T, 1, D] with the first half of each row negated (see `rotate`)."""

    positions: torch.Tensor | None = None
    cos_sin_cache: torch.Tensor | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] -> rotated (in place on CUDA)."""
        if self.cos_sin_cache is not None:
            from fitserve.kernels.rotary import rotary_embedding

            return rotary_embedding(self.positions, q, k, self.cos_sin_cache)
        return self.rotate(q), self.rotate(k)

    def rotate_(self, x: torch.Tensor) -> torch.Tensor:
        """rotate(x), written over x when fitserve's C rotary kernel takes it (float32 on a CPU it builds
        on: one call instead of four operations, the same values bit for bit); else a new tensor. For
        a caller that owns x and reads only the result."""
        assert self.cos is not None and self.sin is not None, "rotate_() needs the table form (not CUDA)"
        kernels = load_cpu_kernels()
        if kernels is not None and kernels.elementwise.rotary_supports(x, self.cos, self.sin):
            return kernels.elementwise.rotary_(x, self.cos, self.sin)
        return self.rotate(x)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] (any heads: q's, k's, or both side by side) -> a new rotated tensor, with the
        table form only. Equals HF's `x * cos + rotate_half(x) * sin` bit for bit: rotate_half(x) is x
        rolled by half a head with its first half negated, and the negation moved onto sin is exact."""
        assert self.cos is not None and self.sin is not None, "rotate() needs the table form (not CUDA)"
        return x * self.cos + x.roll(x.shape[-1] // 2, dims=-1) * self.sin
