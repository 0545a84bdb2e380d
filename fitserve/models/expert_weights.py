"""MoE expert tensors of HF checkpoints, one expert at a time, into layers/moe.py's fused parameters.

Qwen-MoE checkpoints (Qwen3-MoE, Qwen3.5/3.6 MoE) store each expert's projections under
`...mlp.experts.<e>.<gate|up|down>_proj.weight`; transformers 5 saves them fused instead
(`...mlp.experts.gate_up_proj` [E, 2I, hidden], `...mlp.experts.down_proj` [E, hidden, I]), which load by
name through FusedExperts' own weight loader. Both forms come to the same parameters. A quantized
checkpoint's experts (`...mlp.experts.<e>.gate_proj.qweight` ..., in the format's own names) go to the
layer's quantized experts: layers/moe_int4.py's Int4FusedExperts, which packs each projection once its
tensors have arrived, or layers/moe_fp8.py's Fp8FusedExperts (`weight` and its scale).
"""

from __future__ import annotations

import torch
from torch import nn

from fitserve.layers.moe_fp8 import Fp8FusedExperts
from fitserve.layers.moe_int4 import Int4FusedExperts
from fitserve.layers.tp_shards import rank_rows
from fitserve.models.parameter_loads import ParameterLoads


def load_expert(
    root: nn.Module,
    name: str,
    tensor: torch.Tensor,
    loads: ParameterLoads,
    experts: dict[str, set[tuple[int, str]]],
) -> bool:
    """A per-expert checkpoint tensor (`...mlp.experts.<e>.<gate|up|down>_proj.weight`) of `root` (a
    model, or Qwen3.5's MTP module: models/qwen3_5_mtp.py) copied into its rows of the fused parameters, this
    rank's part of it (layers/moe.py: under expert parallel only the rank's experts, whole; else every
    expert's slice of the intermediate dim); False for the fused form, which loads by name."""
    prefix, _, rest = name.partition(".mlp.experts.")
    parts = rest.split(".")
    if len(parts) != 3 or not parts[0].isdigit():
        return False
    expert, projection = int(parts[0]), parts[1]
    base = f"{prefix}.mlp.experts."
    gate_up, down = loads.param(name, base + "gate_up_proj"), loads.param(name, base + "down_proj")
    module = root.get_submodule(base.removesuffix("."))
    local = expert - module.first_expert
    width = down.shape[-1]
    # the intermediate rows this rank holds (all of them under expert parallel or on one rank)
    start = 0 if module.expert_parallel else module.tp_rank * width
    if projection not in ("gate_proj", "up_proj", "down_proj"):
        raise ValueError(f"checkpoint tensor {name!r}: an expert has gate_proj, up_proj and down_proj")
    with torch.no_grad():
        if not 0 <= local < module.local_experts:
            pass  # another rank's expert (expert parallel): counted as loaded, not kept
        elif projection == "gate_proj":
            gate_up[local, :width].copy_(rank_rows(tensor, 0, start, width))
        elif projection == "up_proj":
            gate_up[local, width:].copy_(rank_rows(tensor, 0, start, width))
        else:
            down[local].copy_(rank_rows(tensor, 1, start, width))
    seen = experts.setdefault(base, set())
    seen.add((expert, projection))
    if len(seen) == 3 * module.num_experts:
        loads.loaded.update((base + "gate_up_proj", base + "down_proj"))
    return True


QUANTIZED_EXPERTS = (Int4FusedExperts, Fp8FusedExperts)


def load_quantized_expert(
    root: nn.Module, name: str, tensor: torch.Tensor, marker: str = ".mlp.experts."
) -> bool:
    """A quantized checkpoint's expert tensor (`...<marker><e>.<projection>.<param>`: Qwen's
    `.mlp.experts.`, Gemma-4's `.experts.`), or under --quantization fp8 a 16-bit one (per expert, or
    transformers 5's fused `...<marker>gate_up_proj`), given to the layer's int4 or fp8 experts; False when
    the layer's experts are 16-bit."""
    prefix, _, rest = name.partition(marker)
    experts = root.get_submodule(prefix + marker.rstrip("."))
    if not isinstance(experts, QUANTIZED_EXPERTS):
        return False
    if "." not in rest:  # transformers 5's fused form of 16-bit experts (`gate_up_proj`, `down_proj`)
        if not isinstance(experts, Fp8FusedExperts):
            raise ValueError(
                f"checkpoint tensor {name}: fused experts in an int4 checkpoint (it stores them per expert)"
            )
        experts.load_fused(rest, tensor)
        return True
    expert, projection, param = rest.split(".", 2)
    experts.load_tensor(int(expert), projection, param, tensor)
    return True


def check_quantized_experts_loaded(root: nn.Module) -> None:
    """ValueError naming what the checkpoint did not give once every tensor has loaded: a quantized expert
    projection with none of its tensors, or an fp8 one without its scale (it would compute with zeros)."""
    for module in root.modules():
        missing = module.missing() if isinstance(module, QUANTIZED_EXPERTS) else []
        if missing:
            kind = "int4" if isinstance(module, Int4FusedExperts) else "fp8"
            raise ValueError(
                f"the checkpoint has no {kind} tensors for {len(missing)} expert projection(s), e.g. "
                f"{', '.join(missing[:3])}: it does not match the model's config.json"
            )
