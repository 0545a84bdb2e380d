"""Which formats a MoE's fused experts run (Qwen3-MoE, Qwen3.5/3.6 MoE, Gemma-4 26B-A4B), from the config
alone, for the models and the planner: 16-bit experts, an int4 checkpoint's experts without act order
(layers/moe_int4.py), or fp8 (layers/moe_fp8.py: an FP8 checkpoint's, or --quantization fp8 on a 16-bit
one); a format that would store or make them anything else (bitsandbytes, act order) is refused before
anything is built, naming what runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fitserve.layers.moe import FusedExperts
from fitserve.layers.moe_fp8 import Fp8FusedExperts
from fitserve.layers.moe_int4 import Int4FusedExperts
from fitserve.layers.quantization.fp8_format import Fp8Format
from fitserve.layers.quantization.quant_config import Int4Format

# the names a checkpoint may give one layer's experts: transformers 5's fused tensors, the hub's per-expert
EXPERT_NAMES = ("gate_up_proj", "down_proj", "0.gate_proj", "0.up_proj", "0.down_proj")


# where a layer's experts sit: Qwen's under its MLP, Gemma-4's beside it
QWEN_EXPERTS, GEMMA_EXPERTS = "mlp.experts", "experts"


def experts_quantized(config: Any, fmt: Any, layer_idx: int, block: str = QWEN_EXPERTS) -> bool:
    """Whether `fmt` stores layer `layer_idx`'s experts (`layers.<i>.<block>`) quantized: its ignore list
    leaves them out neither under the name the checkpoint gives them (`model.language_model.layers...` in
    a ConditionalGeneration checkpoint) nor under the one fitserve reads them as (`model.layers...`)."""
    if fmt is None:
        return False
    prefixes = {"model.", str(getattr(config, "weights_prefix", "model."))}
    return all(
        fmt.quantizes(f"{prefix}layers.{layer_idx}.{block}.{name}")
        for prefix in prefixes
        for name in EXPERT_NAMES
    )


def int4_experts(config: Any, fmt: Any, layer_idx: int, block: str = QWEN_EXPERTS) -> bool:
    """Whether layer `layer_idx`'s experts run as int4 (an int4 checkpoint that quantizes them)."""
    return isinstance(fmt, Int4Format) and experts_quantized(config, fmt, layer_idx, block)


def fp8_experts(config: Any, fmt: Any, layer_idx: int, block: str = QWEN_EXPERTS) -> bool:
    """Whether layer `layer_idx`'s experts run as fp8 (an FP8 checkpoint that quantizes them, or
    --quantization fp8 on a 16-bit one)."""
    return isinstance(fmt, Fp8Format) and experts_quantized(config, fmt, layer_idx, block)


def runs_quantized_experts(fmt: Any) -> bool:
    """Whether experts stored in `fmt` run: an int4 checkpoint's without act order, an FP8 checkpoint's or
    a 16-bit one's under --quantization fp8."""
    if isinstance(fmt, Int4Format):
        return not fmt.act_order
    return isinstance(fmt, Fp8Format)


def layer_experts(
    config: Any,
    quant: Any,
    layer_idx: int,
    activation: Callable[[torch.Tensor], torch.Tensor],
    expert_parallel: bool,
    block: str = QWEN_EXPERTS,
) -> nn.Module:
    """Layer `layer_idx`'s experts (config's num_experts of moe_intermediate_size): int4 (layers/moe_int4.py)
    or fp8 (layers/moe_fp8.py) where the checkpoint's format quantizes them, else 16-bit (layers/moe.py)."""
    experts, hidden, width = (
        int(config.num_experts),
        int(config.hidden_size),
        int(config.moe_intermediate_size),
    )
    prefix = f"model.layers.{layer_idx}.{block}"
    if int4_experts(config, quant, layer_idx, block):
        return Int4FusedExperts(experts, hidden, width, activation, quant, prefix, expert_parallel)
    if fp8_experts(config, quant, layer_idx, block):
        return Fp8FusedExperts(experts, hidden, width, activation, quant, prefix, expert_parallel)
    return FusedExperts(experts, hidden, width, activation, expert_parallel=expert_parallel)


def refuse_quantized_experts(
    config: Any,
    fmt: Any,
    model: str,
    sparse_layers: list[int],
    block: str = QWEN_EXPERTS,
    with_architecture: bool = False,
) -> None:
    """ValueError when `fmt` (the checkpoint's format or --quantization) would quantize the experts of the
    `sparse_layers` in a form they do not run: int4 checkpoints (without act order), FP8 checkpoints and
    --quantization fp8 run, bitsandbytes does not. `model` names the model in the message
    (e.g. "Qwen3-MoE model"), followed by its architecture when `with_architecture` and its expert count."""
    if fmt is None or not any(experts_quantized(config, fmt, i, block) for i in sparse_layers):
        return
    if runs_quantized_experts(fmt):
        return
    why = "int4 with act order (g_idx)" if isinstance(fmt, Int4Format) else "this format"
    which = f"{config.architectures[0]}, " if with_architecture else ""
    raise ValueError(
        f"{fmt.describe()} for a {model} ({which}{int(config.num_experts)} experts): fitserve's fused MoE "
        f"experts run 16-bit, int4 (without act order) or fp8 weights, not {why} (a quantized checkpoint "
        "whose ignore list does not name the experts, or --quantization bitsandbytes on a 16-bit MoE "
        "checkpoint). What runs: an AWQ / GPTQ (desc_act false) / compressed-tensors W4A16 / AutoRound or an "
        "FP8 checkpoint of the model, or the 16-bit one as it is or with --quantization fp8 (`fitserve plan "
        "MODEL` says what it needs and how it fits: --tensor-parallel-size, --cpu-offload-gb)"
    )
