"""The planner's estimate of each non-KV memory term of one rank (`MemoryTerms` in planner/memory.py).

- weights: all of them before offloading (on the CPU in the forms it keeps), one rank's share with tensor
  parallelism, one pipeline stage's layers, the --cpu-offload-gb split of the decoder layers, and a
  speculative draft model's footprint;
- activation peak: the larger of one eager forward and the sampling of a step of max_num_batched_tokens,
  plus the int4 dequantization scratch and Gemma-4's RoPE tables;
- CUDA graphs: the decode graphs' pool and kernel state, and the pieces of steps with prompt tokens;
- runtime overhead: what a GPU process adds outside torch's allocations (NCCL's buffers with several
  ranks), or the Python process on the CPU.

Every term is an estimate from the shapes (docs/memory.md derives each one); the engine measures the same
terms at startup (worker/platforms.py).
"""

from __future__ import annotations

import math
from dataclasses import replace

from fitserve.capture_sizes import piecewise_capture_sizes
from fitserve.distributed.pipeline import stage_layer_ranges
from fitserve.offload_split import NO_OFFLOAD, OffloadSplit, first_layers_holding, offload_too_large_message
from fitserve.planner.formats import DTYPE_BYTES, quant_method
from fitserve.planner.hardware import GiB
from fitserve.planner.memory_inputs import DraftFootprint, MemoryInputs
from fitserve.planner.model_shape import ModelShape
from fitserve.planner.weights import NO_CPU_FORMS, CpuKeptForms, WeightInventory

MiB = 1024**2
# Memory the engine adds on a GPU outside torch's allocations once it runs: cuBLAS/cuBLASLt workspaces,
# kernel images. Like vLLM, fitserve counts it from a baseline taken after its CUDA context exists, so
# neither the context (~0.5 GiB) nor other processes' memory is in it. Measured 0.16 GiB on an H100
# (torch 2.11, CUDA 13, Qwen3-0.6B shape; benchmarks/results/h100_equal.json's log).
GPU_RUNTIME_OVERHEAD_BYTES = 164 * MiB
# Extra per GPU with tensor or pipeline parallelism: NCCL's communicator buffers.
TP_COMMUNICATION_BYTES = 512 * MiB
# On the CPU the "overhead" is the Python process itself: interpreter, torch, tokenizer.
CPU_RUNTIME_OVERHEAD_BYTES = 512 * MiB
# One captured CUDA graph keeps its kernels' parameters and launch state: ~256 KiB per decoder layer.
CUDA_GRAPH_BYTES_PER_LAYER = 256 * 1024
# The sampler (worker/sampler.py) edits and filters logits in float32 copies of this many rows at a time,
# so its float32 working set does not grow with max_num_seqs.
SAMPLER_ROWS_PER_CHUNK = 32
# Bytes per logit of one such chunk at its largest stage, top-p's sort (worker/sampler.py's table): the
# chunk's float32 copy (4), the top-p rows gathered out of a chunk that mixes them with others (4), the
# sorted values and their int64 token ids (4 + 8), and the scratch of torch's stable CUDA sort of fewer
# than 128 rows (aten SortStable.cu, segmented_sort_pairs_by_full_sort: two int2 (token, row) arrays
# 8 + 8, the keys it sorts into 4, and cub's radix sort buffers of a key and an int2 4 + 8).
SAMPLER_CHUNK_BYTES_PER_LOGIT = 4 + 4 + (4 + 8) + (8 + 8 + 4 + 4 + 8)


def weight_bytes_total(inputs: MemoryInputs) -> int:
    """All weights in memory, over all ranks, before offloading; on the CPU, in the forms it keeps."""
    counts = inputs.weights.counts
    forms = cpu_kept_forms(inputs)
    int4 = forms.int4_params
    linear = math.ceil(
        (counts.linear - int4) * linear_bytes_per_param(inputs) + int4 * forms.int4_bytes_per_weight
    )
    head_copy = 2 * inputs.shape.vocab_size * inputs.shape.hidden_size if forms.fp16_head else 0
    scales = fp8_on_load_scale_bytes(inputs)
    gpu_forms = inputs.weights.gpu_extra_bytes if inputs.on_gpu else 0
    stored = inputs.weights.stored_bytes + gpu_forms
    return stored + linear + counts.other * DTYPE_BYTES[inputs.dtype] + head_copy + scales


def fp8_on_load_scale_bytes(inputs: MemoryInputs) -> int:
    """--quantization fp8 on a 16-bit checkpoint: one float32 scale per output row of every decoder
    projection (layers/quantization/fp8_method.py); the weights themselves are 1 byte each (formats.py)."""
    if (inputs.quantization or "").lower() != "fp8" or inputs.weights.checkpoint_quantization is not None:
        return 0
    shape = inputs.shape
    attention = (shape.num_attention_heads + 2 * shape.num_kv_heads) * shape.head_dim + shape.hidden_size
    experts = max(1, shape.num_experts)
    width = shape.moe_intermediate_size if shape.num_experts else shape.intermediate_size
    mlp = experts * (2 * width + shape.hidden_size)
    if shape.shared_expert_intermediate_size:
        mlp += 2 * shape.shared_expert_intermediate_size + shape.hidden_size
    return 4 * shape.num_layers * (attention + mlp)


def cpu_kept_forms(inputs: MemoryInputs) -> CpuKeptForms:
    """The int4 matrices and float16 LM head the CPU engine keeps (planner/weights.py), where they apply:
    on the CPU; the int4 matrices without --quantization (which quantizes them its own way), the float16
    head (never quantized) only beside float32 weights."""
    forms = inputs.weights.cpu_forms
    if inputs.on_gpu or forms == NO_CPU_FORMS:
        return NO_CPU_FORMS
    if inputs.quantization is not None:
        forms = replace(forms, int4_params=0)
    return replace(forms, fp16_head=forms.fp16_head and inputs.dtype == "float32")


def linear_bytes_per_param(inputs: MemoryInputs) -> float:
    """Bytes per projection-matrix parameter: the model dtype, or the --quantization method's bits.

    A checkpoint that is already quantized keeps its own storage (`stored_bytes`); the flag adds nothing.
    """
    if inputs.quantization is None or inputs.weights.checkpoint_quantization is not None:
        return DTYPE_BYTES[inputs.dtype]
    return quant_method(inputs.quantization).bits_per_weight / 8


def weight_bytes_per_gpu(inputs: MemoryInputs) -> int:
    """One rank's share: everything but the norms and routers is split across the ranks; a rank holds
    whole copies of K/V projection heads when ranks outnumber KV heads."""
    tp = inputs.tensor_parallel_size
    total = weight_bytes_total(inputs)
    if tp == 1:
        return total
    replicated = inputs.weights.counts.replicated * DTYPE_BYTES[inputs.dtype]
    per_rank = (total - replicated) // tp + replicated
    shape = inputs.shape
    extra_kv_heads = shape.kv_heads_per_rank(tp) - shape.num_kv_heads / tp
    if extra_kv_heads > 0:
        kv_proj_params_per_head = 2 * shape.num_layers * shape.hidden_size * shape.head_dim
        per_rank += int(kv_proj_params_per_head * extra_kv_heads * linear_bytes_per_param(inputs))
    return per_rank


def embedding_bytes_per_gpu(inputs: MemoryInputs) -> int:
    """One rank's share of the [vocab, hidden] embedding (or of an untied LM head: the same size)."""
    rows = math.ceil(inputs.shape.vocab_size / inputs.tensor_parallel_size)
    return rows * inputs.shape.hidden_size * DTYPE_BYTES[inputs.dtype]


def stage_weight_bytes(inputs: MemoryInputs, stage: int) -> int:
    """One rank of pipeline stage `stage`: its decoder layers, the embedding on the first stage, the final
    norm and the LM head on the last (a tied head reads an embedding the last stage then also holds)."""
    shape = inputs.shape
    start, end = stage_layer_ranges(shape.num_layers, inputs.pipeline_parallel_size)[stage]
    held = (end - start) * decoder_layer_bytes_per_gpu(inputs)
    if stage == 0:
        held += embedding_bytes_per_gpu(inputs)
    if stage == inputs.pipeline_parallel_size - 1:
        held += embedding_bytes_per_gpu(inputs) + shape.hidden_size * DTYPE_BYTES[inputs.dtype]
    return held


def decoder_layer_bytes_per_gpu(inputs: MemoryInputs) -> int:
    """One decoder layer's weights on one rank: all weights less the embeddings, the LM head and the final
    norm, shared out over the layers (every layer of the modelled families has the same shapes)."""
    shape = inputs.shape
    element = DTYPE_BYTES[inputs.dtype]
    tables = shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
    outside_layers = math.ceil(tables / inputs.tensor_parallel_size) * element + shape.hidden_size * element
    return max(0, weight_bytes_per_gpu(inputs) - outside_layers) // shape.num_layers


def offload_split(inputs: MemoryInputs) -> tuple[OffloadSplit, str | None]:
    """The engine's --cpu-offload-gb choice of layers (fitserve/offload_split.py), and a note when more
    is asked than the decoder layers hold (the plan then offloads them all; the engine refuses it)."""
    if not inputs.on_gpu or inputs.cpu_offload_gb <= 0:
        return NO_OFFLOAD, None
    layers = [decoder_layer_bytes_per_gpu(inputs)] * inputs.shape.num_layers
    wanted = inputs.cpu_offload_gb * GiB
    split = first_layers_holding(layers, wanted)
    if wanted <= sum(layers):
        return split, None
    too_large = offload_too_large_message(inputs.cpu_offload_gb, sum(layers), len(layers))
    return split, f"{too_large}; the plan offloads all {len(layers)} layers"


def draft_footprint(
    inputs: MemoryInputs, name: str, shape: ModelShape, weights: WeightInventory, quantization: str | None
) -> DraftFootprint:
    """The draft model `name` of these shapes and weights, on the target's device and dtype (one device:
    the draft is not split across tensor-parallel ranks)."""
    alone = replace(
        inputs,
        shape=shape,
        weights=weights,
        quantization=quantization,
        tensor_parallel_size=1,
        cpu_offload_gb=0.0,
        draft=None,
    )
    return DraftFootprint(name, weight_bytes_total(alone), shape.kv_elements_per_token(1))


def forward_activation_bytes(inputs: MemoryInputs, num_tokens: int) -> int:
    """Peak of one eager forward over `num_tokens` tokens: the residual stream plus the larger of the
    attention and MLP temporaries of one layer (layers run one after another)."""
    shape, tp = inputs.shape, inputs.tensor_parallel_size
    d = DTYPE_BYTES[inputs.dtype]
    hidden = shape.hidden_size
    q = shape.q_size // tp
    kv = shape.kv_heads_per_rank(tp) * shape.head_dim
    residual_stream = 2 * num_tokens * hidden * d  # the residual and the normed hidden states
    # packed qkv, rotated q and k, the attention output; RoPE's cos and sin in float32
    attention = num_tokens * ((q + 2 * kv) + (q + kv) + q) * d + 2 * num_tokens * shape.head_dim * 4
    if shape.is_moe:
        routed = shape.num_experts_per_tok * num_tokens
        mlp = (
            num_tokens * shape.num_experts * 4  # router logits
            + routed * (3 * shape.moe_intermediate_size // tp + hidden) * d  # gate_up, act, gathered rows
            + num_tokens * 3 * shape.shared_expert_intermediate_size // tp * d
        )
    else:
        mlp = num_tokens * 3 * (shape.intermediate_size // tp) * d  # gate_up output and SiLU-and-mul
    ids_and_positions = 2 * num_tokens * 8
    return residual_stream + max(attention, mlp) + ids_and_positions


def sampling_activation_bytes(inputs: MemoryInputs, num_tokens: int, num_rows: int) -> int:
    """The sampling of a step of `num_tokens` tokens and `num_rows` sampled rows, at its peak:

    - the final hidden states of every token (the model dtype), alive until the step ends;
    - the LM head's logits of the sampled rows: the model dtype on a GPU, float32 on the CPU
      (layers/vocab_embedding.py), only read by the sampler;
    - the larger of what the sampler adds to them (worker/sampler.py's table): the logits of the random
      rows gathered for the race kernel when greedy rows sit beside them (at most all rows again), or
      one float32 chunk of SAMPLER_ROWS_PER_CHUNK rows at its largest stage
      (SAMPLER_CHUNK_BYTES_PER_LOGIT per logit). Logprobs come after the sampling, in chunks of the
      same rows and fewer bytes per logit.

    Not counted: prompt logprobs, whose logits are those of the prompt positions scored in the step (up
    to num_tokens rows; the model runner computes them per request).
    """
    d = DTYPE_BYTES[inputs.dtype]
    vocab = inputs.shape.vocab_size
    logit_bytes = d if inputs.on_gpu else 4
    hidden_states = num_tokens * inputs.shape.hidden_size * d
    logits = num_rows * vocab * logit_bytes
    float32_chunk = min(num_rows, SAMPLER_ROWS_PER_CHUNK) * vocab * SAMPLER_CHUNK_BYTES_PER_LOGIT
    return hidden_states + logits + max(logits, float32_chunk)


def activation_peak_bytes(inputs: MemoryInputs) -> int:
    """The larger of the forward and the sampling peaks of a step of max_num_batched_tokens tokens."""
    tokens = inputs.max_num_batched_tokens
    rows = min(inputs.max_num_seqs, tokens)
    peak = max(forward_activation_bytes(inputs, tokens), sampling_activation_bytes(inputs, tokens, rows))
    return peak + dequant_scratch_bytes(inputs) + rope_table_bytes(inputs)


def rope_table_bytes(inputs: MemoryInputs) -> int:
    """Gemma-4 on a GPU: a cos/sin table per layer type, [max_model_len, that type's head_dim] in the
    model dtype (models/gemma4.py), built by the profiling run and kept."""
    if not inputs.on_gpu or inputs.shape.model_type != "gemma4_text":
        return 0
    head_dims = {spec.layer_type: spec.head_dim for spec in inputs.shape.kv_layers}
    return sum(head_dims.values()) * inputs.max_model_len * DTYPE_BYTES[inputs.dtype]


# kernels/int4_dequant.py's SCRATCH_BYTES: on a GPU, quantized layers multiply the rows of a long step
# through chunks of their weight dequantized into one buffer of this size (allocated in the profiling run).
DEQUANT_SCRATCH_BYTES = 64 << 20


def dequant_scratch_bytes(inputs: MemoryInputs) -> int:
    quantized = inputs.weights.checkpoint_quantization is not None or bool(inputs.quantization)
    return DEQUANT_SCRATCH_BYTES if inputs.on_gpu and quantized else 0


def cuda_graph_bytes(inputs: MemoryInputs) -> int:
    """The decode graphs' pool: the activations of the largest captured batch (smaller captures reuse
    that pool), plus each graph's own kernel state; and the same for the pieces of steps with prompt
    tokens (worker/piecewise_graphs.py), which are captured whenever the decode graphs are, unless
    layers are offloaded to the CPU."""
    sizes = inputs.cudagraph_capture_sizes
    if not inputs.on_gpu or not sizes or inputs.pipeline_parallel_size > 1:  # stages run eagerly
        return 0
    largest = max(sizes)
    pool = (
        forward_activation_bytes(inputs, largest)
        + largest * inputs.shape.vocab_size * DTYPE_BYTES[inputs.dtype]
    )
    decode = pool + len(sizes) * inputs.shape.num_layers * CUDA_GRAPH_BYTES_PER_LAYER
    if inputs.cpu_offload_gb > 0:
        return decode
    piece_sizes = piecewise_capture_sizes(inputs.max_num_batched_tokens, inputs.device.total_bytes)
    # a piece is about one layer; a model of L layers is cut into L + 1 of them
    pieces = len(piece_sizes) * (inputs.shape.num_layers + 1) * CUDA_GRAPH_BYTES_PER_LAYER
    return decode + forward_activation_bytes(inputs, max(piece_sizes)) + pieces


def runtime_overhead_bytes(inputs: MemoryInputs) -> int:
    if not inputs.on_gpu:
        return CPU_RUNTIME_OVERHEAD_BYTES
    communication = TP_COMMUNICATION_BYTES if inputs.world_size > 1 else 0
    return GPU_RUNTIME_OVERHEAD_BYTES + communication
