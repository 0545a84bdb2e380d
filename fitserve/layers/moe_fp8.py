"""MoE experts of an FP8 checkpoint (Qwen3-30B-A3B-FP8 and Qwen3.6-35B-A3B-FP8 with [128, 128] block scales,
compressed-tensors FP8 with per-channel or per-tensor scales): the experts of layers/moe.py with 1-byte
weights, on GPUs of compute capability 7.5 and up. One token (decode at batch 1) runs weight-only
(W8A16) through kernels/moe_decode.py's two kernels, its k experts streamed once; more tokens run
kernels/fused_moe_fp8.py's grouped kernels W8A8 as vLLM runs FP8 MoE checkpoints: the input and the
intermediate quantized per token and 128 columns (dynamic, amax / 448), the products fp8 x fp8 on the
tensor cores (a hidden size that is not whole 128-column groups stays W8A16). Below compute capability
8.9 (Turing, Ampere: no fp8 tensor cores, no e4m3 in Triton) every batch runs W8A16 on the weights'
bytes, decoded in the kernels (kernels/fp8_bits.py), as vLLM's fp8 Marlin runs them there.

Each expert's projections load from the checkpoint's per-expert tensors (`experts.<e>.gate_proj.weight`
float8_e4m3fn, its `weight_scale_inv` or `weight_scale`; a static `input_scale` is checked and not used:
activations are quantized dynamically), each scale becoming the canonical float32 [rows, G] form of
layers/quantization/fp8_weight.py (G = 1 for a scale a row, else the block's columns; a block's scale
repeated over its rows), cut to this rank's part as FusedExperts cuts 16-bit experts (its experts under
expert parallel, else every expert's intermediate slice: gate and up rows, down's columns and, for block
scales, their whole blocks), into buffers that hold every local expert:
  w13 float8 [E, 2W, hidden], w13_scale float32 [E, 2W, G(hidden)]
  w2  float8 [E, hidden, W],  w2_scale  float32 [E, hidden, G(W)]
The CPU path dequantizes the chosen experts and runs FusedExperts' torch arithmetic on them with 16-bit
activations; `reference` is that arithmetic with the activations quantized as the kernels quantize them
(`fake_quantize_groups`) wherever they run W8A8: the GPU tests' reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fitserve.layers.moe_quantized import PROJECTIONS, QuantizedExperts
from fitserve.layers.quantization.fp8_format import Fp8Format
from fitserve.layers.quantization.fp8_weight import FP8, expand_scale, quantize_fp8, random_fp8_weight
from fitserve.layers.quantization.int4_method import layer_seed


class Fp8FusedExperts(QuantizedExperts):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: Callable[[torch.Tensor], torch.Tensor],
        fmt: Fp8Format,
        prefix: str,
        expert_parallel: bool = False,
    ) -> None:
        """Sizes are the whole model's; the buffers hold this rank's experts or intermediate slice.
        ValueError (before anything loads) for a tensor-parallel slice of down's columns that splits a
        scale block."""
        sizes = (num_experts, hidden_size, intermediate_size)
        super().__init__(*sizes, activation, fmt, prefix, expert_parallel)
        split, width = self.split, self.intermediate_per_rank
        block_rows, block_cols = fmt.block if fmt.strategy == "block" and fmt.block else (0, 0)
        self.block_rows, self.block_cols = block_rows, block_cols
        if block_cols and split.size > 1 and not self.expert_parallel and width % block_cols:
            raise ValueError(  # every rank refuses alike (rank 0's own columns would start at 0)
                f"{prefix}: {fmt.describe()} scales the experts' {intermediate_size} intermediate columns "
                f"in blocks of {block_cols}, and each of the {split.size} tensor-parallel ranks' {width} of "
                "them would start inside a block: run with --enable-expert-parallel (each rank then holds "
                f"whole experts) or a tensor-parallel size that gives each rank a multiple of {block_cols} "
                "columns"
            )
        self.group_up = block_cols or hidden_size
        self.group_down = block_cols or width
        local = self.local_experts
        groups_up, groups_down = -(-hidden_size // self.group_up), -(-width // self.group_down)
        self.register_buffer("w13", torch.zeros(local, 2 * width, hidden_size, dtype=FP8))
        self.register_buffer("w13_scale", torch.ones(local, 2 * width, groups_up, dtype=torch.float32))
        self.register_buffer("w2", torch.zeros(local, hidden_size, width, dtype=FP8))
        self.register_buffer("w2_scale", torch.ones(local, hidden_size, groups_down, dtype=torch.float32))
        self._pending: dict[tuple[int, str], dict[str, torch.Tensor]] = {}

    # --- loading -----------------------------------------------------------------------------------------

    def _scale_shape(self, projection: str) -> tuple[int, ...]:
        in_features, out_features = self._shape(projection)
        if self.fmt.strategy == "block":
            return (-(-out_features // self.block_rows), -(-in_features // self.block_cols))
        return (out_features, 1) if self.fmt.strategy == "channel" else ()

    def load_tensor(self, expert: int, projection: str, name: str, tensor: torch.Tensor) -> None:
        """One checkpoint tensor of expert `expert` (global id), `projection` (gate_proj, up_proj, down_proj)
        named as the format names it (weight, weight_scale_inv / weight_scale, input_scale), or under
        --quantization fp8 a 16-bit `weight`, quantized whole as it arrives (one scale a row, round to
        nearest of w / (amax / 448)) on the experts' device, so the 16-bit experts never sit there.
        ValueError for a name the format does not have, a dtype or a shape that does not fit, naming it."""
        what = f"{self.prefix}.{expert}.{projection}.{name}"
        if projection not in PROJECTIONS or not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint tensor {what}: not a tensor of {self.fmt.describe()} experts")
        if self.fmt.quantize_on_load:
            self._check_16bit(projection, name, tensor, what)
        else:
            self._check_fp8(projection, name, tensor, what)
        if name == "input_scale":
            return  # the experts run weight-only: activations stay 16-bit
        local = expert - self.first_expert
        if not 0 <= local < self.local_experts:
            if name == "weight":
                self._done.add((expert, projection))
            return  # another rank's expert (expert parallel): counted, not kept
        if self.fmt.quantize_on_load:
            quantized = quantize_fp8(tensor.to(self.w13.device))
            self.store(local, projection, quantized.data, quantized.scale)
            return
        pending = self._pending.setdefault((expert, projection), {})
        pending[name] = tensor
        if {"weight", self.fmt.scale_name} - set(pending):
            return  # the weight or its scale is still to come
        del self._pending[(expert, projection)]
        in_features, out_features = self._shape(projection)
        scale = self._canonical_scale(pending[self.fmt.scale_name].float(), out_features, in_features)
        self.store(local, projection, pending["weight"], scale)

    def _check_fp8(self, projection: str, name: str, tensor: torch.Tensor, what: str) -> None:
        """An FP8 checkpoint's tensor: one of the format's names, its shape (a per-channel scale [N] or
        [N, 1]), an e4m3 weight, a positive single value for a per-tensor or input scale."""
        if name not in {"weight", self.fmt.scale_name, "input_scale"}:
            raise ValueError(f"checkpoint tensor {what}: not a tensor of {self.fmt.describe()} experts")
        in_features, out_features = self._shape(projection)
        if name == "input_scale" or (name == self.fmt.scale_name and self.fmt.strategy == "tensor"):
            if tensor.numel() != 1 or not float(tensor.float().reshape(())) > 0:
                raise ValueError(f"{what}: expected one positive scale, got {tuple(tensor.shape)} {tensor}")
            return
        expected = (out_features, in_features) if name == "weight" else self._scale_shape(projection)
        channel_vector = name != "weight" and self.fmt.strategy == "channel" and tensor.dim() == 1
        if tuple(tensor.shape) != (expected[:1] if channel_vector else expected):
            raise ValueError(
                f"quantized tensor {what} has shape {tuple(tensor.shape)}, expected {expected} for "
                f"{self.fmt.describe()}: the checkpoint is truncated or does not match config.json"
            )
        if name == "weight" and tensor.dtype != FP8:
            raise ValueError(
                f"quantized tensor {what} is {tensor.dtype}, expected float8_e4m3fn for "
                f"{self.fmt.describe()}: the checkpoint does not match config.json's quantization_config"
            )

    def _check_16bit(self, projection: str, name: str, tensor: torch.Tensor, what: str) -> None:
        """A 16-bit checkpoint's expert weight under --quantization fp8: a float weight of the full shape."""
        in_features, out_features = self._shape(projection)
        if name != "weight":
            raise ValueError(f"checkpoint tensor {what}: not a tensor of 16-bit MoE experts")
        if not tensor.is_floating_point() or tensor.dtype == FP8:
            raise ValueError(
                f"checkpoint tensor {what} is {tensor.dtype}: --quantization fp8 quantizes 16- or 32-bit "
                "float weights while loading; pass the model's bf16/fp16 checkpoint"
            )
        if tuple(tensor.shape) != (out_features, in_features):
            raise ValueError(
                f"checkpoint tensor {what} has shape {tuple(tensor.shape)}, expected "
                f"{(out_features, in_features)}: the checkpoint is truncated or does not match config.json"
            )

    def load_fused(self, name: str, tensor: torch.Tensor) -> None:
        """transformers 5's fused form of a 16-bit checkpoint's experts (`gate_up_proj` [E, 2I, hidden] or
        `down_proj` [E, hidden, I]), quantized expert by expert under --quantization fp8."""
        width = self.intermediate_size
        whole = {"gate_up_proj": (2 * width, self.hidden_size), "down_proj": (self.hidden_size, width)}
        if not self.fmt.quantize_on_load or name not in whole:
            raise ValueError(
                f"checkpoint tensor {self.prefix}.{name}: fused experts load into 16-bit experts or, "
                f"quantized while loading, with --quantization fp8; {self.fmt.describe()} stores them per "
                "expert"
            )
        if tuple(tensor.shape) != (self.num_experts, *whole[name]):
            raise ValueError(
                f"checkpoint tensor {self.prefix}.{name} has shape {tuple(tensor.shape)}, expected "
                f"{(self.num_experts, *whole[name])}: the checkpoint does not match config.json"
            )
        for expert in range(self.num_experts):
            if name == "down_proj":
                self.load_tensor(expert, "down_proj", "weight", tensor[expert])
            else:
                self.load_tensor(expert, "gate_proj", "weight", tensor[expert, :width])
                self.load_tensor(expert, "up_proj", "weight", tensor[expert, width:])

    def _canonical_scale(self, loaded: torch.Tensor, rows: int, in_features: int) -> torch.Tensor:
        """A checkpoint scale -> float32 [rows, G]: a block's repeated over its rows, a tensor's over all."""
        if self.fmt.strategy == "block":
            return loaded.repeat_interleave(self.block_rows, dim=0)[:rows]
        return loaded.reshape(-1, 1).expand(rows, 1) if loaded.numel() == 1 else loaded.reshape(rows, 1)

    def store(self, local: int, projection: str, weight: torch.Tensor, scale: torch.Tensor) -> None:
        """Expert `local`'s whole projection (fp8 [N, K] and its canonical scale [N, G]), cut to this rank
        and copied into its buffers."""
        expert = self.first_expert + local
        width, start = self.intermediate_per_rank, self.rank_start()
        device = self.w13.device
        with torch.no_grad():
            if projection == "down_proj":  # this rank's columns and, for block scales, their blocks
                self.w2[local].copy_(weight[:, start : start + width].to(device))
                if self.block_cols:
                    first = start // self.block_cols
                    scale = scale[:, first : first + self.w2_scale.shape[2]]
                self.w2_scale[local].copy_(scale.to(device))
            else:  # gate rows then up rows, this rank's slice of each
                at = slice(0, width) if projection == "gate_proj" else slice(width, 2 * width)
                self.w13[local, at].copy_(weight[start : start + width].to(device))
                self.w13_scale[local, at].copy_(scale[start : start + width].to(device))
        self._done.add((expert, projection))

    def initialize_dummy(self, seed: int, std: float, device: torch.device | str | None = None) -> None:
        """--load-format dummy: every expert's projections drawn whole as random fp8 weights (each from its
        own generator, the same at every tensor-parallel size) and stored as a loaded checkpoint's are."""
        on = torch.device(device) if device is not None else self.w13.device
        for expert in range(self.first_expert, self.first_expert + self.local_experts):
            for projection in PROJECTIONS:
                in_features, out_features = self._shape(projection)
                generator = torch.Generator(device=on)
                generator.manual_seed(layer_seed(seed, f"{self.prefix}.{expert}.{projection}"))
                group = self.block_cols or None
                block_rows = self.fmt.block[0] if self.block_cols else 1
                weight = random_fp8_weight(out_features, in_features, group, std, generator, on, block_rows)
                self.store(expert - self.first_expert, projection, weight.data, weight.scale)

    # --- running -----------------------------------------------------------------------------------------

    def run_kernels(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        from fitserve.kernels import moe_decode
        from fitserve.kernels.fused_moe_fp8 import Fp8Experts, check_inputs, fp8_experts_run_on, fused_moe_fp8

        if not fp8_experts_run_on(x.device) or self.kernel_activation is None:
            raise ValueError(
                f"{self.prefix}: fp8 experts run on GPUs of compute capability 7.5 and up (Turing and "
                "later) with silu, gelu_tanh or gelu activations; on this GPU use the model's int4 "
                "(AWQ / GPTQ) or 16-bit checkpoint"
            )
        gate_up = Fp8Experts(self.w13, self.w13_scale, self.group_up)
        down = Fp8Experts(self.w2, self.w2_scale, self.group_down)
        routing = (ids, weights, self.kernel_activation, self.first_expert)
        if moe_decode.takes(x.shape[0]):  # one token: its k experts streamed in two kernels (W8A16)
            check_inputs(x, gate_up, down, ids)
            return moe_decode.moe_decode(x, gate_up, down, *routing)
        return fused_moe_fp8(x, gate_up, down, *routing)

    def quantizes_activations(self, x: torch.Tensor) -> bool:
        """Whether the kernels run x W8A8 (fused_moe_fp8's grouped path past a decode-sized batch, with a
        hidden size of whole groups); the decode kernels and the CPU keep the activations 16-bit."""
        from fitserve.kernels import moe_decode
        from fitserve.kernels.fused_moe_fp8 import runs_w8a8

        return x.is_cuda and not moe_decode.takes(x.shape[0]) and runs_w8a8(x)

    def reference(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The torch path (QuantizedExperts.reference), with x and the intermediate quantized as the
        kernels quantize them where they run W8A8 (`quantizes_activations`)."""
        seen = fake_quantize_groups if self.quantizes_activations(x) else None
        return super().reference(x, topk_ids, topk_weights, seen)

    def dequantized(self, local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `local`'s (gate_up [2W, hidden], down [hidden, W]) in float32."""
        w13 = self.w13[local].float() * expand_scale(self.w13_scale[local], self.group_up, self.hidden_size)
        width = self.intermediate_per_rank
        w2 = self.w2[local].float() * expand_scale(self.w2_scale[local], self.group_down, width)
        return w13, w2


def fake_quantize_groups(values: torch.Tensor, group: int = 128) -> torch.Tensor:
    """values [..., K] quantized to e4m3 per `group` columns and dequantized, in values' dtype (float32 in
    QuantizedExperts.reference): each group's
    scale its amax times float32(1 / 448) (the kernels' and torch's CUDA arithmetic; at least 1e-12), a
    partial last group on its own. What W8A8's GEMMs see of their activations."""
    floats = values.float()
    out = torch.empty_like(floats)
    inverse = torch.tensor(1 / 448, dtype=torch.float32, device=values.device)
    for start in range(0, floats.shape[-1], group):
        part = floats[..., start : start + group]
        scale = (part.abs().amax(dim=-1, keepdim=True) * inverse).clamp(min=1e-12)
        quantized = (part / scale).clamp(-448, 448).to(FP8)
        out[..., start : start + group] = quantized.float() * scale
    return out.to(values.dtype)
