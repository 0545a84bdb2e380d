"""The memory plan: a pure function from (model shape, weights, dtypes, device, limits) to bytes per GPU.

On a GPU, as in vLLM, `gpu_memory_utilization` is the fraction of the GPU's total memory this engine may
use. Out of that budget come the weights, the activation peak of one step at max_num_batched_tokens,
the CUDA graph pool and the runtime's own memory; what remains becomes KV cache blocks. On the CPU the
budget is the RAM available and the KV cache is the engine's own rule (fitserve/cpu_kv_cache.py):
--cpu-kv-cache-space, else 2 requests of max_model_len within half the RAM the weights leave; the
weights count the int4 and float16 forms the CPU engine keeps (planner/weights.py, CpuKeptForms).
With tensor_parallel_size N every number is one rank's (one GPU's; on the CPU one of N processes, whose
budget is 1/N of the RAM available and whose KV cache is sized from 1/N of what all N ranks' weights
leave). With pipeline_parallel_size P each stage holds its range of decoder layers (distributed/pipeline.py),
the first the embedding, the last the final norm and LM head: every stage keeps the same KV blocks, so
the pool is the fewest blocks any stage's rank has room for, and the plan's numbers are that stage's.

Every term is an estimate from the shapes (docs/memory.md derives each one). The engine calls
`plan_memory` again at startup with what it measured (`MemoryTerms`), which sizes the KV cache from
the measured numbers, and logs `planned_vs_measured` of the two plans.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from fitserve.capture_sizes import piecewise_capture_sizes
from fitserve.config import DEFAULT_GPU_MEMORY_UTILIZATION
from fitserve.cpu_kv_cache import CpuKvCacheSize, cpu_kv_cache_size
from fitserve.distributed.pipeline import describe_split, stage_kv_layers, stage_layer_ranges
from fitserve.kv_groups import KvCacheGroup, elements_per_request_token, group_num_blocks, kv_cache_groups
from fitserve.offload_split import NO_OFFLOAD, OffloadSplit, first_layers_holding, offload_too_large_message
from fitserve.planner.formats import DTYPE_BYTES, kv_cache_bytes_per_element, quant_method
from fitserve.planner.hardware import DeviceSpec, GiB
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
# The sampler's float32 working copies of the [rows, vocab] logits: the logits, probabilities, and
# the sorted values plus int64 indices of a top-k/top-p sort (counted as 2).
SAMPLER_FP32_COPIES = 4


@dataclass(frozen=True)
class DraftFootprint:
    """A draft model of speculative decoding (method draft_model) on the target's device: its weights,
    and its keys and values per token, held beside the target's in a pool of as many blocks."""

    name: str
    weight_bytes: int
    kv_elements_per_token: int


@dataclass(frozen=True)
class MemoryInputs:
    """Everything the plan depends on; the settings are resolved (no "auto" except kv_cache_dtype)."""

    shape: ModelShape
    weights: WeightInventory
    device: DeviceSpec  # the GPU each tensor-parallel rank plans for (the smallest), or the CPU
    dtype: str  # "bfloat16" | "float16" | "float32"
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # stages, each of tensor_parallel_size ranks (distributed/pipeline.py)
    cpu_offload_gb: float = 0.0  # per GPU, as vLLM's --cpu-offload-gb
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    cudagraph_capture_sizes: tuple[int, ...] = ()  # () = eager
    num_gpu_blocks_override: int | None = None
    cpu_kv_cache_space_gib: float | None = None  # None: sized by fitserve/cpu_kv_cache.py's rule
    # --mamba-cache-mode as resolved ("none" without prefix caching): a hybrid's state snapshots
    mamba_cache_mode: str = "none"
    draft: DraftFootprint | None = None  # --speculative-config method draft_model
    # --speculative-config's k (any method): a hybrid model's state pool holds k more rows per request
    speculative_tokens: int = 0

    @property
    def on_gpu(self) -> bool:
        return self.device.kind == "cuda"

    @property
    def world_size(self) -> int:
        """Ranks (GPUs, or CPU processes) of the engine: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class MemoryTerms:
    """The non-KV memory of one GPU (bytes): what the planner estimates, or what the engine measured."""

    weights: int
    activation: int
    cuda_graphs: int
    runtime_overhead: int

    @property
    def total(self) -> int:
        return self.weights + self.activation + self.cuda_graphs + self.runtime_overhead


@dataclass(frozen=True)
class MemoryPlan:
    inputs: MemoryInputs
    terms: MemoryTerms  # the terms the KV cache was sized from
    estimated: MemoryTerms  # the planner's estimates (== terms unless measured ones were given)
    weights_bytes_per_gpu_before_offload: int
    weights_offloaded_bytes: int  # per GPU, kept in CPU memory
    budget_bytes: int  # per GPU: total x gpu_memory_utilization (CPU: the rank's share of the RAM available)
    kv_bytes_per_token: int  # per GPU
    num_kv_blocks: int  # allocated, the null block included
    kv_cache_bytes: int  # per GPU
    free_for_kv_bytes: int  # per GPU: budget minus the terms; negative when they do not fit
    notes: tuple[str, ...] = field(default=())
    offload: OffloadSplit = NO_OFFLOAD  # --cpu-offload-gb: the decoder layers kept in CPU memory
    cpu_kv: CpuKvCacheSize | None = None  # on the CPU: the KV cache's size and why (the engine's rule)
    # per GPU: hybrid models' recurrent state pool (max_num_seqs + 1 live slots and the prefix cache's
    # snapshot slots), before the KV cache
    recurrent_state_bytes: int = 0
    state_snapshot_bytes: int = 0  # the snapshot slots' part of recurrent_state_bytes
    pipeline_stage: int = 0  # with pipeline stages: the stage one of whose ranks these numbers are

    @property
    def num_layers_held(self) -> int:
        """The decoder layers this plan's rank holds: its pipeline stage's (all of them without stages)."""
        shape, stages = self.inputs.shape, self.inputs.pipeline_parallel_size
        if stages == 1:
            return shape.num_layers
        start, end = stage_layer_ranges(shape.num_layers, stages)[self.pipeline_stage]
        return end - start

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.inputs.block_size

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens requests can use: every block but the reserved null block (the engine's count)."""
        return max(0, self.num_kv_blocks - 1) * self.inputs.block_size

    @property
    def max_concurrency(self) -> float:
        """How many max_model_len requests the KV cache holds at once."""
        blocks_per_request = math.ceil(self.inputs.max_model_len / self.inputs.block_size)
        return max(0, self.num_kv_blocks - 1) / blocks_per_request

    @property
    def group_num_blocks(self) -> tuple[int, ...]:
        """Each KV cache group's pool (null block included), in kv_groups order; (num_kv_blocks,) for one."""
        groups = kv_groups(self.inputs)
        if len(groups) <= 1:
            return (self.num_kv_blocks,)
        full_need = math.ceil(self.inputs.max_model_len / self.inputs.block_size)
        return group_num_blocks(groups, self.num_kv_blocks, full_need)

    @property
    def weights_gib_per_gpu(self) -> float:
        return self.terms.weights / GiB

    @property
    def activation_gib(self) -> float:
        return self.terms.activation / GiB

    @property
    def cuda_graph_gib(self) -> float:
        return self.terms.cuda_graphs / GiB

    @property
    def runtime_overhead_gib(self) -> float:
        return self.terms.runtime_overhead / GiB

    @property
    def kv_cache_gib_per_gpu(self) -> float:
        return self.kv_cache_bytes / GiB


def plan_memory(inputs: MemoryInputs, measured: MemoryTerms | None = None) -> MemoryPlan:
    """The plan for `inputs`; with `measured`, the KV cache is sized from the measured terms instead.
    With pipeline stages, the plan of the stage whose ranks hold the fewest KV blocks (every stage
    keeps the same blocks), with a note naming the split."""
    _check_inputs(inputs)
    stages = inputs.pipeline_parallel_size
    if stages == 1:
        return _plan(inputs, measured, weight_bytes_per_gpu(inputs), kv_bytes_per_token(inputs))
    plans = [
        _plan(inputs, measured, stage_weight_bytes(inputs, stage), stage_kv_bytes_per_token(inputs, stage))
        for stage in range(stages)
    ]
    fullest = min(range(stages), key=lambda stage: (plans[stage].num_kv_blocks, -stage))
    split = describe_split(inputs.shape.num_layers, stages)
    note = (
        f"pipeline parallel: {split}; every number is one rank of stage {fullest}, the one with room for "
        "the fewest KV blocks (every stage keeps the same blocks). Stages run one after another on one "
        "batch at a time"
    )
    return replace(plans[fullest], notes=(*plans[fullest].notes, note), pipeline_stage=fullest)


def _plan(inputs: MemoryInputs, measured: MemoryTerms | None, on_disk: int, per_token: int) -> MemoryPlan:
    """The plan of one rank holding `on_disk` bytes of weights and `per_token` KV bytes per token."""
    offload, offload_note = offload_split(inputs)
    draft_weights = inputs.draft.weight_bytes if inputs.draft is not None else 0
    estimated = MemoryTerms(
        weights=on_disk - offload.gpu_bytes_saved + draft_weights,
        activation=activation_peak_bytes(inputs),
        cuda_graphs=cuda_graph_bytes(inputs),
        runtime_overhead=runtime_overhead_bytes(inputs),
    )
    terms = measured or estimated
    block_bytes = per_token * inputs.block_size
    state = recurrent_state_bytes(inputs)
    if inputs.on_gpu:
        budget = int(inputs.device.total_bytes * inputs.gpu_memory_utilization)
        free_for_kv = budget - terms.total - state
        cpu_kv = None
    else:
        # Ranks are processes sharing the host's RAM: each plans for its share of it.
        ranks = inputs.world_size
        budget = inputs.device.free_bytes // ranks
        # the RAM available once every rank's weights are loaded: what the engine reads when it sizes the
        # cache (cpu_kv_size splits it between the ranks)
        cpu_kv = None
        if inputs.num_gpu_blocks_override is None:
            left = inputs.device.free_bytes - ranks * (terms.weights + state)
            cpu_kv = cpu_kv_size(inputs, max(0, left), per_token)
        free_for_kv = cpu_kv.bytes if cpu_kv is not None else 0
    if inputs.num_gpu_blocks_override is not None:
        num_blocks = inputs.num_gpu_blocks_override
    else:
        num_blocks = max(0, free_for_kv // block_bytes)
    notes = [offload_note] if offload_note else []
    return MemoryPlan(
        inputs=inputs,
        terms=terms,
        estimated=estimated,
        weights_bytes_per_gpu_before_offload=on_disk,
        weights_offloaded_bytes=offload.offloaded_bytes,
        budget_bytes=budget,
        kv_bytes_per_token=per_token,
        num_kv_blocks=num_blocks,
        kv_cache_bytes=num_blocks * block_bytes,
        free_for_kv_bytes=free_for_kv,
        notes=tuple(notes),
        offload=offload,
        cpu_kv=cpu_kv,
        recurrent_state_bytes=state,
        state_snapshot_bytes=state_snapshot_bytes(inputs),
    )


def recurrent_state_bytes(inputs: MemoryInputs) -> int:
    """A hybrid model's state pool on one rank: max_num_seqs + 1 live slots and the snapshot slots of
    prefix caching (worker/recurrent_state.py, core/state_slots.py), each every DeltaNet layer's conv state
    (model dtype) and recurrent state (float32); 0 for attention-only models."""
    per_seq = state_bytes_per_seq_on_rank(inputs)
    from fitserve.core.state_slots import num_ring_rows

    if not per_seq:
        return 0
    rows = inputs.max_num_seqs + 1 + num_ring_rows(inputs.max_num_seqs, inputs.speculative_tokens)
    return rows * per_seq + state_snapshot_bytes(inputs)


def state_bytes_per_seq_on_rank(inputs: MemoryInputs) -> int:
    """One request's recurrent state on one rank: tensor parallel splits the DeltaNet key and value heads
    evenly (models/qwen3_5_layers.py), so each rank's slots hold 1/tensor_parallel_size of the whole."""
    per_seq = inputs.shape.state_bytes_per_seq(DTYPE_BYTES[inputs.dtype])
    return -(-per_seq // inputs.tensor_parallel_size)


def state_snapshot_bytes(inputs: MemoryInputs) -> int:
    """The snapshot slots' share of recurrent_state_bytes (--mamba-cache-mode align: 2 x max_num_seqs,
    at most 16; core/state_slots.py num_snapshot_slots)."""
    from fitserve.core.state_slots import num_snapshot_slots

    per_seq = state_bytes_per_seq_on_rank(inputs)
    return num_snapshot_slots(inputs.mamba_cache_mode, True, inputs.max_num_seqs) * per_seq


def cpu_kv_size(
    inputs: MemoryInputs, available_bytes: int | None, per_token: int | None = None
) -> CpuKvCacheSize:
    """One rank's CPU KV cache for these settings; `available_bytes`: the RAM the weights of every rank
    leave on the host, split between the ranks; `per_token`: the rank's KV bytes per token (default: all
    layers', as without pipeline stages)."""
    return cpu_kv_cache_size(
        inputs.cpu_kv_cache_space_gib,
        max_model_len=inputs.max_model_len,
        max_num_batched_tokens=inputs.max_num_batched_tokens,
        max_num_seqs=inputs.max_num_seqs,
        block_size=inputs.block_size,
        kv_bytes_per_token=kv_bytes_per_token(inputs) if per_token is None else per_token,
        available_bytes=available_bytes,
        ranks=inputs.world_size,
    )


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


def stage_kv_bytes_per_token(inputs: MemoryInputs, stage: int) -> int:
    """kv_bytes_per_token over the decoder layers pipeline stage `stage` holds."""
    shape = inputs.shape
    start, end = stage_layer_ranges(shape.num_layers, inputs.pipeline_parallel_size)[stage]
    element = kv_cache_bytes_per_element(inputs.kv_cache_dtype, inputs.dtype)
    if not shape.kv_layers:
        heads = shape.kv_heads_per_rank(inputs.tensor_parallel_size)
        return 2 * (end - start) * heads * shape.head_dim * element
    groups = kv_cache_groups(
        stage_kv_layers(shape.kv_layers, start, end),
        inputs.max_model_len,
        inputs.max_num_batched_tokens,
        inputs.block_size,
        inputs.tensor_parallel_size,
    )
    return elements_per_request_token(groups, inputs.max_model_len, inputs.block_size) * element


def for_pipeline_stage(plan: MemoryPlan, per_token: int) -> MemoryPlan:
    """A plan sized over every layer, re-sized for a pipeline stage's rank that keeps `per_token` KV bytes
    per token (its layers'): on a GPU the memory left for the cache holds more blocks; on the CPU the
    pool keeps its tokens (the engine's rule counts requests), in fewer bytes. A fixed pool
    (num_gpu_blocks_override) keeps its blocks."""
    inputs = plan.inputs
    blocks = plan.num_kv_blocks
    if inputs.on_gpu and inputs.num_gpu_blocks_override is None:
        blocks = max(0, plan.free_for_kv_bytes // (per_token * inputs.block_size))
    return replace(
        plan,
        kv_bytes_per_token=per_token,
        num_kv_blocks=blocks,
        kv_cache_bytes=blocks * per_token * inputs.block_size,
    )


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


def kv_groups(inputs: MemoryInputs) -> tuple[KvCacheGroup, ...]:
    """The KV cache groups the engine allocates (fitserve/kv_groups.py); () for a model whose layers are
    alike (no per-layer geometry): one full group."""
    if not inputs.shape.kv_layers:
        return ()
    return kv_cache_groups(
        inputs.shape.kv_layers,
        inputs.max_model_len,
        inputs.max_num_batched_tokens,
        inputs.block_size,
        inputs.tensor_parallel_size,
    )


def kv_bytes_per_context_token(inputs: MemoryInputs) -> int:
    """K and V of every layer that owns a cache for one token on one rank, windows or not."""
    element = kv_cache_bytes_per_element(inputs.kv_cache_dtype, inputs.dtype)
    return inputs.shape.kv_elements_per_token(inputs.tensor_parallel_size) * element


def kv_bytes_per_token(inputs: MemoryInputs) -> int:
    """K and V of every layer that owns a cache (each with its own geometry) for one token of a
    max_model_len request on one rank; a sliding-window group counts only the blocks its window keeps
    (fitserve/kv_groups.py), so a pool of N tokens holds N / max_model_len full-length requests."""
    groups = kv_groups(inputs)
    if not groups:
        return kv_bytes_per_context_token(inputs) + draft_kv_bytes_per_token(inputs)
    element = kv_cache_bytes_per_element(inputs.kv_cache_dtype, inputs.dtype)
    target = elements_per_request_token(groups, inputs.max_model_len, inputs.block_size) * element
    return target + draft_kv_bytes_per_token(inputs)


def draft_kv_bytes_per_token(inputs: MemoryInputs) -> int:
    """A draft model's keys and values per token (its pool has as many blocks as the target's); 0 without."""
    if inputs.draft is None:
        return 0
    element = kv_cache_bytes_per_element(inputs.kv_cache_dtype, inputs.dtype)
    return inputs.draft.kv_elements_per_token * element


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
    """The final hidden states of the step, plus the LM head's logits for the sampled rows and the
    sampler's float32 copies of them."""
    d = DTYPE_BYTES[inputs.dtype]
    vocab = inputs.shape.vocab_size
    return num_tokens * inputs.shape.hidden_size * d + num_rows * vocab * (d + 4 * SAMPLER_FP32_COPIES)


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


def with_settings(inputs: MemoryInputs, **changes: object) -> MemoryInputs:
    """`inputs` with some settings changed (a new frozen object)."""
    return replace(inputs, **changes)  # type: ignore[arg-type]


def planned_vs_measured(planned: MemoryPlan, measured: MemoryPlan) -> list[str]:
    """Log lines comparing the plan made before loading with the one sized from measurements."""
    rows = [
        ("weights", planned.terms.weights, measured.terms.weights),
        ("activation peak", planned.terms.activation, measured.terms.activation),
        ("CUDA graphs", planned.terms.cuda_graphs, measured.terms.cuda_graphs),
        ("runtime overhead", planned.terms.runtime_overhead, measured.terms.runtime_overhead),
        ("KV cache", planned.kv_cache_bytes, measured.kv_cache_bytes),
    ]
    lines = [
        f"{name}: planned {p / GiB:.2f} GiB, measured {m / GiB:.2f} GiB ({_relative(p, m)})"
        for name, p, m in rows
    ]
    lines.append(
        f"KV cache tokens: planned {planned.kv_cache_tokens:,}, measured {measured.kv_cache_tokens:,} "
        f"({_relative(planned.kv_cache_tokens, measured.kv_cache_tokens)})"
    )
    return lines


def _relative(planned: float, measured: float) -> str:
    if measured == 0:
        return "exact" if planned == 0 else "n/a"
    return f"{(planned - measured) / measured * 100:+.1f}%"


def _check_inputs(inputs: MemoryInputs) -> None:
    if inputs.dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={inputs.dtype!r} is not one of {', '.join(DTYPE_BYTES)}: resolve it first")
    positive = {
        "max_model_len": inputs.max_model_len,
        "max_num_batched_tokens": inputs.max_num_batched_tokens,
        "max_num_seqs": inputs.max_num_seqs,
        "block_size": inputs.block_size,
        "tensor_parallel_size": inputs.tensor_parallel_size,
        "pipeline_parallel_size": inputs.pipeline_parallel_size,
    }
    for name, value in positive.items():
        if value < 1:
            raise ValueError(
                f"{name}={value} is below the minimum 1: set --{name.replace('_', '-')} to 1 or more"
            )
