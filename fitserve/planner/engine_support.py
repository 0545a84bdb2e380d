"""What fitserve's engine runs of what the planner sizes.

The planner plans every setting vLLM has, so that its advice holds for both engines; fitserve's own
engine refuses some of them ("not supported yet" in fitserve/args.py). Every suggestion or note that
names such a setting says so, in these words, and the planner lists the settings fitserve runs first.
CPU offload (--cpu-offload-gb), fp8 KV cache (--kv-cache-dtype fp8), int4 AWQ / GPTQ checkpoints
(without offload), tensor parallel (--tensor-parallel-size: ranks on GPUs with NCCL, or CPU ranks with
gloo) and pipeline parallel (--pipeline-parallel-size, the Llama, Mistral, Qwen2, Qwen3 and Qwen3-MoE
families) count as run.
"""

from __future__ import annotations

# EngineArgs field -> why a run with it needs vLLM for now.
NOT_RUN_BY_FITSERVE: dict[str, str] = {
    "quantization": "fitserve runs int4, fp8 and bitsandbytes, not this method yet; vLLM does",
}
# Why a MoE model quantized this way needs vLLM: fitserve's engine refuses it before loading (the fused
# experts of layers/moe.py hold 16-bit weights, layers/moe_int4.py's int4 ones for the model types below;
# models/*_config.py refuse_quantized_*).
MOE_QUANTIZATION = (
    "fitserve runs MoE experts 16-bit, int4 or fp8 (int4 and FP8 checkpoints, --quantization fp8) on "
    "Qwen3-MoE, Qwen3.5/3.6 MoE and Gemma-4 MoE, not this method yet; vLLM runs them"
)
# MoE model types whose experts run an int4 checkpoint (AWQ, GPTQ, compressed-tensors W4A16, AutoRound), an
# FP8 one or --quantization fp8 (the fp8 experts from this compute capability on: kernels/fused_moe_fp8.py)
INT4_EXPERT_MODEL_TYPES = ("qwen3_moe", "qwen3_5_moe_text", "gemma4_text")
# kernels/capability.FP8_WEIGHTS_MIN_CAPABILITY (16-bit tensor cores; below 8.9 the kernels decode the
# e4m3 bytes themselves); not imported: this module stays free of torch
FP8_EXPERTS_MIN_CAPABILITY = (7, 5)


def vllm_only(suggestion: str, setting: str) -> str:
    """`suggestion` with the plain reason fitserve cannot run it: `--quantization modelopt ... (fitserve
    runs int4, fp8 and bitsandbytes, not this method yet; vLLM does)`."""
    return f"{suggestion} ({NOT_RUN_BY_FITSERVE[setting]})"
