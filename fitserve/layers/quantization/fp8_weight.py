"""The one fp8 form every fp8 checkpoint format (and --quantization fp8) becomes at load.

    w[n, k] = float(data[n, k]) * scale[n, k // group_k]

`data` is float8_e4m3fn [N, K]; `scale` float32 [N, G], G = ceil(K / group_k): G = 1 (group_k = K) for
per-tensor and per-channel scales (a per-tensor scale repeated over its rows, so a fused layer keeps each
projection's own scale), G = K / block columns for block scales (each block's scale repeated over its
rows). `dequantize` is the float32 reference every path is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_MIN_SCALE = 1e-12  # an all-zero row gets this scale, not 0 (no division by zero when quantizing)
_CHUNK_ELEMENTS = 1 << 24  # rows quantized / dequantized at a time: about 64 MiB of float32


@dataclass
class Fp8Weight:
    data: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [N, G]
    group_k: int  # columns per scale: K for per-channel, the block's columns for block scales

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def in_features(self) -> int:
        return self.data.shape[1]

    def check(self) -> None:
        """ValueError naming the field whose shape or dtype does not fit the others."""
        if self.data.dtype != FP8 or self.data.dim() != 2:
            raise ValueError(
                f"Fp8Weight.data must be 2-D float8_e4m3fn, got {self.data.dtype} {self.data.dim()}-D"
            )
        rows, cols = self.data.shape
        groups = (rows, -(-cols // self.group_k))
        if tuple(self.scale.shape) != groups or self.scale.dtype != torch.float32:
            raise ValueError(
                f"Fp8Weight.scale is {self.scale.dtype} {tuple(self.scale.shape)}, not float32 {groups}"
            )


def expand_scale(scale: torch.Tensor, group_k: int, in_features: int) -> torch.Tensor:
    """[N, G] -> [N, K]: each column's scale."""
    if scale.shape[1] == 1:
        return scale.expand(scale.shape[0], in_features)
    return scale.repeat_interleave(group_k, dim=1)[:, :in_features]


def dequantize_rows(weight: Fp8Weight, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows start..stop of the weight in `dtype` (computed in float32)."""
    values = weight.data[start:stop].float()
    values.mul_(expand_scale(weight.scale[start:stop], weight.group_k, weight.in_features))
    return values.to(dtype)


def dequantize(weight: Fp8Weight) -> torch.Tensor:
    """The float32 weight [N, K]."""
    return dequantize_rows(weight, 0, weight.out_features, torch.float32)


def rows_per_chunk(in_features: int, elements: int = _CHUNK_ELEMENTS) -> int:
    return max(1, elements // max(1, in_features))


def quantize_fp8(weight: torch.Tensor, group_k: int | None = None, group_rows: int = 1) -> Fp8Weight:
    """Round-to-nearest fp8 of a float weight [N, K]: one float32 scale per row (group_k None) or per
    row and `group_k` columns, amax / 448, on the weight's device, a chunk of rows at a time. With
    `group_rows` > 1 a scale covers that many rows too (a checkpoint's [128, 128] blocks), kept in the
    canonical form: each block's scale repeated over its rows."""
    rows, cols = weight.shape
    group = cols if group_k is None else group_k
    groups = -(-cols // group)
    data = torch.empty((rows, cols), dtype=FP8, device=weight.device)
    scale = torch.empty((rows, groups), dtype=torch.float32, device=weight.device)
    step = rows_per_chunk(cols)
    step = max(group_rows, step - step % group_rows)  # chunks end on block edges
    for start in range(0, rows, step):
        chunk = weight[start : start + step].to(torch.float32, copy=True)
        if groups == 1:
            amax = chunk.abs().amax(dim=1, keepdim=True)
        else:
            padded = torch.nn.functional.pad(chunk, (0, groups * group - cols))
            amax = padded.view(chunk.shape[0], groups, group).abs().amax(dim=-1)
        if group_rows > 1:
            amax = _block_amax(amax, group_rows)
        chunk_scale = amax.div_(FP8_MAX).clamp_(min=_MIN_SCALE)
        scale[start : start + step] = chunk_scale
        scaled = chunk.div_(chunk_scale if groups == 1 else expand_scale(chunk_scale, group, cols))
        data[start : start + step] = scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(data, scale, group)


def _block_amax(amax: torch.Tensor, group_rows: int) -> torch.Tensor:
    """[R, G] amax of each row's groups -> the amax of each group_rows-row block, repeated over its rows."""
    rows = amax.shape[0]
    padded = torch.nn.functional.pad(amax, (0, 0, 0, -rows % group_rows))  # amax >= 0: zeros change nothing
    blocks = padded.view(-1, group_rows, amax.shape[1]).amax(dim=1)
    return blocks.repeat_interleave(group_rows, dim=0)[:rows]


def random_fp8_weight(
    out_features: int,
    in_features: int,
    group_k: int | None,
    std: float,
    generator: torch.Generator,
    device: torch.device | str | None = None,
    group_rows: int = 1,
) -> Fp8Weight:
    """A random Fp8Weight on `device` (the generator's): N(0, std) values quantized as quantize_fp8 does
    (with `group_rows`, in blocks of that many rows, as block-scaled checkpoints are), drawn a chunk of
    rows at a time (at most _CHUNK_ELEMENTS float32 at once). Reproducible for a generator state."""
    group = in_features if group_k is None else group_k
    parts = []
    step = rows_per_chunk(in_features)
    step = max(group_rows, step - step % group_rows)
    for start in range(0, out_features, step):
        rows = min(step, out_features - start)
        drawn = torch.empty((rows, in_features), device=device).normal_(0.0, std, generator=generator)
        parts.append(quantize_fp8(drawn, group, group_rows))
    data = torch.cat([part.data for part in parts])
    scale = torch.cat([part.scale for part in parts])
    return Fp8Weight(data, scale, group)
