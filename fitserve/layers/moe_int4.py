"""MoE experts of an int4 checkpoint (AWQ, GPTQ without act order, compressed-tensors W4A16, AutoRound): the
experts of layers/moe.py with 4-bit weights, run by kernels/fused_moe_int4.py on CUDA.

Each expert's projections load from the checkpoint's per-expert tensors (`experts.<e>.gate_proj.qweight`,
... in the format's own names), become the canonical Int4Weight (layers/quantization/int4_formats.py),
are cut to this rank's part as FusedExperts cuts 16-bit experts (its experts under expert parallel, else
every expert's intermediate slice: gate and up rows, down's columns and their groups), and are packed into
the kernels' layout (kernels/int4_repack.py), gate rows then up rows, one expert at a time, into buffers
that hold every local expert (so --cpu-offload-gb moves them as it moves any buffer):
  w13_qweight int32 [E, 2W, Kp(hidden) / 8], w13_scale_zero [E, G, 2W, 2]
  w2_qweight  int32 [E, hidden, Kp(W) / 8],  w2_scale_zero  [E, G, hidden, 2]
in the model dtype (float32 for a float32 model, which runs on the CPU only). The CPU path dequantizes the
chosen experts and runs FusedExperts' torch arithmetic on them (the kernels' reference).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fitserve.kernels.int4_repack import BLOCK_K, dequantize_words, pack_words, scale_zero_pairs
from fitserve.layers.moe_quantized import PROJECTIONS, QuantizedExperts
from fitserve.layers.quantization.int4_formats import optional_params, param_specs, to_int4_weight
from fitserve.layers.quantization.int4_method import layer_seed
from fitserve.layers.quantization.int4_weight import Int4Weight, random_int4_weight
from fitserve.layers.quantization.quant_config import Int4Format


class Int4FusedExperts(QuantizedExperts):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: Callable[[torch.Tensor], torch.Tensor],
        fmt: Int4Format,
        prefix: str,
        expert_parallel: bool = False,
    ) -> None:
        """Sizes are the whole model's; the buffers hold this rank's experts or intermediate slice. ValueError
        (before anything loads) for act order, or an intermediate slice that splits a quantization group."""
        sizes = (num_experts, hidden_size, intermediate_size)
        super().__init__(*sizes, activation, fmt, prefix, expert_parallel)
        width = self.intermediate_per_rank
        if fmt.act_order:
            raise ValueError(
                f"{prefix}: {fmt.describe()}: MoE experts run int4 without act order (g_idx) only; use a "
                "checkpoint quantized without desc_act / actorder"
            )
        self.group_up = fmt.group_for(hidden_size)
        whole_down_group = fmt.group_for(intermediate_size)
        # per-channel down rows keep one scale per row over this rank's columns too
        self.group_down = width if whole_down_group == intermediate_size else whole_down_group
        if width % self.group_down:
            raise ValueError(
                f"{prefix}: {fmt.describe()} groups the experts' {intermediate_size} intermediate columns "
                f"by {whole_down_group}, and each tensor-parallel rank's {width} of them would split a "
                "group: run with --enable-expert-parallel (each rank then holds whole experts) or a "
                f"tensor-parallel size that gives each rank a multiple of {whole_down_group} columns"
            )
        dtype = torch.get_default_dtype()
        up_padded = -(-hidden_size // BLOCK_K) * BLOCK_K
        down_padded = -(-width // BLOCK_K) * BLOCK_K
        local = self.local_experts
        self.register_buffer("w13_qweight", torch.zeros(local, 2 * width, up_padded // 8, dtype=torch.int32))
        groups = -(-up_padded // self.group_up)
        self.register_buffer("w13_scale_zero", torch.zeros(local, groups, 2 * width, 2, dtype=dtype))
        self.register_buffer(
            "w2_qweight", torch.zeros(local, hidden_size, down_padded // 8, dtype=torch.int32)
        )
        groups = -(-down_padded // self.group_down)
        self.register_buffer("w2_scale_zero", torch.zeros(local, groups, hidden_size, 2, dtype=dtype))
        self._pending: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        self._converted: dict[tuple[int, str], Int4Weight] = {}

    # --- loading -----------------------------------------------------------------------------------------

    def load_tensor(self, expert: int, projection: str, name: str, tensor: torch.Tensor) -> None:
        """One checkpoint tensor of expert `expert` (global id), `projection` (gate_proj, up_proj,
        down_proj), named as the format names it (qweight, scales, ...). ValueError for a name the format
        does not have or a shape that does not fit."""
        in_features, out_features = self._shape(projection)
        specs = param_specs(self.fmt, in_features, out_features)
        what = f"{self.prefix}.{expert}.{projection}.{name}"
        if name not in specs or projection not in PROJECTIONS or not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint tensor {what}: not a tensor of {self.fmt.describe()} experts")
        if tuple(tensor.shape) != specs[name].shape:
            raise ValueError(
                f"quantized tensor {what} has shape {tuple(tensor.shape)}, expected {specs[name].shape}: the "
                "checkpoint does not match the model's config.json"
            )
        local = expert - self.first_expert
        if not 0 <= local < self.local_experts:
            self._done.add((expert, projection))
            return  # another rank's expert (expert parallel): counted, not kept
        pending = self._pending.setdefault((expert, projection), {})
        pending[name] = tensor
        if set(specs) - optional_params(self.fmt) - set(pending):
            return  # more of this projection's tensors to come
        weight = to_int4_weight(self.fmt, self._pending.pop((expert, projection)), in_features, what)
        if weight.perm is not None:
            raise ValueError(f"{what}: act order (g_idx) in an MoE expert: fitserve runs experts without it")
        self.store(local, projection, weight.to(self.w13_qweight.device))

    def store(self, local: int, projection: str, weight: Int4Weight) -> None:
        """Expert `local`'s whole projection weight, cut to this rank and packed into its buffers (gate and
        up are packed together once both arrived)."""
        expert = self.first_expert + local
        width, start = self.intermediate_per_rank, self.rank_start()
        if projection == "down_proj":  # this rank's columns and their groups (per-channel: the one group)
            group = self.group_down
            groups = (
                slice(start // group, (start + width) // group) if weight.scales.shape[1] > 1 else slice(None)
            )
            columns = weight.codes[:, start : start + width]
            cut = Int4Weight(columns, weight.scales[:, groups], weight.zeros[:, groups], group)
            self._pack_into(self.w2_qweight[local], self.w2_scale_zero[local], cut)
            self._done.add((expert, projection))
            return
        rows = slice(start, start + width)
        self._converted[(local, projection)] = Int4Weight(
            weight.codes[rows], weight.scales[rows], weight.zeros[rows], weight.group_size
        )
        self._done.add((expert, projection))
        gate, up = self._converted.get((local, "gate_proj")), self._converted.get((local, "up_proj"))
        if gate is None or up is None:
            return
        del self._converted[(local, "gate_proj")], self._converted[(local, "up_proj")]
        both = Int4Weight(
            torch.cat((gate.codes, up.codes)),
            torch.cat((gate.scales, up.scales)),
            torch.cat((gate.zeros, up.zeros)),
            gate.group_size,
        )
        self._pack_into(self.w13_qweight[local], self.w13_scale_zero[local], both)

    def _pack_into(self, qweight: torch.Tensor, scale_zero: torch.Tensor, weight: Int4Weight) -> None:
        padded = qweight.shape[-1] * 8
        pairs = scale_zero_pairs(weight.scales, weight.zeros, padded, weight.group_size, scale_zero.dtype)
        with torch.no_grad():
            qweight.copy_(pack_words(weight.codes))
            scale_zero.copy_(pairs)

    def initialize_dummy(self, seed: int, std: float, device: torch.device | str | None = None) -> None:
        """--load-format dummy: every expert's projections drawn whole as random int4 weights (each from its
        own generator, the same at every tensor-parallel size) and stored as a loaded checkpoint's are."""
        on = torch.device(device) if device is not None else self.w13_qweight.device
        for expert in range(self.num_experts):
            local = expert - self.first_expert
            if not 0 <= local < self.local_experts:
                continue
            for projection in PROJECTIONS:
                in_features, out_features = self._shape(projection)
                generator = torch.Generator(device=on)
                generator.manual_seed(layer_seed(seed, f"{self.prefix}.{expert}.{projection}"))
                group = self.fmt.group_for(in_features)
                weight = random_int4_weight(
                    out_features, in_features, group, self.fmt.symmetric, std, generator, on
                )
                self.store(local, projection, weight.to(self.w13_qweight.device))

    # --- running -----------------------------------------------------------------------------------------

    def run_kernels(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        from fitserve.kernels.fused_moe_int4 import PackedExperts, fused_moe_int4

        width, hidden = self.intermediate_per_rank, self.hidden_size
        gate_up = PackedExperts(self.w13_qweight, self.w13_scale_zero, self.group_up, hidden, 2 * width)
        down = PackedExperts(self.w2_qweight, self.w2_scale_zero, self.group_down, width, hidden)
        activation = self.kernel_activation
        if activation is None:
            raise ValueError(f"{self.prefix}: int4 experts run silu, gelu_tanh or gelu activations")
        return fused_moe_int4(x, gate_up, down, ids, weights, activation, self.first_expert)

    def dequantized(self, local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Local expert `local`'s (gate_up [2W, hidden], down [hidden, W]) in float32."""
        width, hidden = self.intermediate_per_rank, self.hidden_size
        w13 = dequantize_words(self.w13_qweight[local], self.w13_scale_zero[local], hidden, self.group_up)
        w2 = dequantize_words(self.w2_qweight[local], self.w2_scale_zero[local], width, self.group_down)
        return w13.float(), w2.float()
