"""The memory plan's arithmetic on known shapes: parameter counts against the published sizes, the 8B on
an H100 against vLLM 0.26's measured KV capacity, and how each setting moves the numbers."""

from __future__ import annotations

import dataclasses

import pytest

from fitserve.planner.hardware import GiB
from fitserve.planner.memory import MemoryTerms, plan_memory, planned_vs_measured
from tests.unit.planner_helpers import memory_inputs, model_info

# vLLM 0.26.0 on one H100 80GB, Llama-3.1-8B shape, bf16, gpu_memory_utilization 0.9, max_model_len 4096.
VLLM_8B_KV_TOKENS = 444_528
VLLM_8B_WEIGHTS_GIB = 15.0


@pytest.mark.parametrize(
    ("name", "published_billions"),
    [
        ("llama-3.1-8b", 8.03),
        ("llama-3.3-70b", 70.55),
        ("qwen3-8b", 8.19),
        ("qwen3-0.6b", 0.596),
        ("deepseek-r1-distill-qwen-7b", 7.62),
    ],
)
def test_parameter_counts_match_published_sizes(name: str, published_billions: float) -> None:
    total = model_info(name).weights.total_params / 1e9
    assert total == pytest.approx(published_billions, rel=0.005)


def test_exact_llama_8b_parameter_count() -> None:
    assert model_info("llama-3.1-8b").weights.total_params == 8_030_261_248


def test_llama_8b_on_h100_matches_vllm_within_3_percent() -> None:
    plan = plan_memory(memory_inputs("llama-3.1-8b"))
    assert plan.kv_bytes_per_token == 128 * 1024
    assert plan.weights_gib_per_gpu == pytest.approx(VLLM_8B_WEIGHTS_GIB, rel=0.03)
    assert plan.kv_cache_tokens == pytest.approx(VLLM_8B_KV_TOKENS, rel=0.03)
    budget = 79.19 * 0.9
    non_kv = plan.weights_gib_per_gpu + plan.activation_gib + plan.cuda_graph_gib + plan.runtime_overhead_gib
    assert non_kv + plan.kv_cache_gib_per_gpu == pytest.approx(budget, abs=plan.block_bytes / GiB)
    assert plan.max_concurrency == pytest.approx(plan.kv_cache_tokens / 4096)


def test_tensor_parallel_halves_weights_and_kv_per_token() -> None:
    one = plan_memory(memory_inputs("llama-3.1-8b"))
    two = plan_memory(memory_inputs("llama-3.1-8b", tensor_parallel_size=2))
    assert two.kv_bytes_per_token * 2 == one.kv_bytes_per_token
    replicated = model_info("llama-3.1-8b").weights.counts.replicated * 2
    assert two.terms.weights == (one.terms.weights - replicated) // 2 + replicated
    assert two.kv_cache_tokens > 2 * one.kv_cache_tokens  # half the weights leave more room, too


def test_tensor_parallel_beyond_kv_heads_copies_kv_heads() -> None:
    sixteen = plan_memory(memory_inputs("llama-3.1-8b", tensor_parallel_size=16))
    eight = plan_memory(memory_inputs("llama-3.1-8b", tensor_parallel_size=8))
    assert sixteen.kv_bytes_per_token == eight.kv_bytes_per_token  # one KV head per rank either way
    # Each of 16 ranks holds a whole KV head's K/V projections (32 layers x 4096 x 128 x 2 x 2 bytes) of
    # which an even split would give it half.
    half_head = 2 * 32 * 4096 * 128 * 2 // 2
    expected = (eight.terms.weights - 266240 * 2) / 2 + 266240 * 2 + half_head
    assert sixteen.terms.weights == pytest.approx(expected, abs=16)


def test_cpu_offload_moves_whole_decoder_layers_and_keeps_one_on_the_gpu() -> None:
    # A Llama-3.1-8B decoder layer: q, o 4096x4096, k, v 4096x1024, gate, up, down 4096x14336, 2 norms.
    layer = (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096) * 2
    base = plan_memory(memory_inputs("llama-3.1-8b"))
    offloaded = plan_memory(memory_inputs("llama-3.1-8b", cpu_offload_gb=4))
    assert offloaded.offload.num_layers == 10  # 4 GiB is 9.85 layers: whole layers, rounded up
    assert offloaded.weights_offloaded_bytes == 10 * layer
    assert offloaded.offload.staging_bytes == layer  # the GPU buffer each offloaded layer is copied into
    assert offloaded.terms.weights == base.terms.weights - 10 * layer + layer
    # Offloaded layers run without the pieces' CUDA graphs (worker/piecewise_graphs.py): that pool goes too.
    pieces = base.terms.cuda_graphs - offloaded.terms.cuda_graphs
    assert pieces > 0
    assert offloaded.kv_cache_bytes - base.kv_cache_bytes == pytest.approx(
        9 * layer + pieces, abs=base.block_bytes
    )


def test_offload_beyond_the_decoder_layers_is_capped_and_noted() -> None:
    plan = plan_memory(memory_inputs("qwen3-0.6b", cpu_offload_gb=50))
    layer = (1024 * 2048 * 2 + 1024 * 1024 * 2 + 3 * 1024 * 3072 + 2 * 1024 + 2 * 128) * 2
    tied_embeddings_and_final_norm = (151936 * 1024 + 1024) * 2
    assert plan.offload.num_layers == 28
    assert plan.terms.weights == tied_embeddings_and_final_norm + layer
    assert plan.notes[0].startswith(
        "cpu_offload_gb=50 is more than the 0.82 GiB of weights in the model's 28 decoder layers"
    )
    assert "set --cpu-offload-gb 0.82 or less; the plan offloads all 28 layers" in plan.notes[0]


def test_fp8_kv_cache_doubles_the_tokens() -> None:
    auto = plan_memory(memory_inputs("llama-3.1-8b"))
    fp8 = plan_memory(memory_inputs("llama-3.1-8b", kv_cache_dtype="fp8"))
    assert fp8.kv_bytes_per_token * 2 == auto.kv_bytes_per_token
    assert fp8.num_kv_blocks in (2 * auto.num_kv_blocks, 2 * auto.num_kv_blocks + 1)


def test_quantization_shrinks_only_the_projection_matrices() -> None:
    info = model_info("llama-3.3-70b")
    counts = info.weights.counts
    bf16 = plan_memory(memory_inputs("llama-3.3-70b", gpus="1x400"))
    awq = plan_memory(memory_inputs("llama-3.3-70b", gpus="1x400", quantization="awq"))
    fp8 = plan_memory(memory_inputs("llama-3.3-70b", gpus="1x400", quantization="fp8"))
    assert bf16.terms.weights == counts.total * 2
    shape = info.shape  # one float32 scale per output row of each of the 80 layers' projections
    rows = (shape.num_attention_heads + 2 * shape.num_kv_heads) * shape.head_dim + 2 * shape.hidden_size
    rows += 2 * shape.intermediate_size
    assert fp8.terms.weights == counts.linear + counts.other * 2 + 4 * shape.num_layers * rows
    assert awq.terms.weights == pytest.approx(counts.linear * (4 + 20 / 128) / 8 + counts.other * 2, abs=1)
    # published AWQ INT4 checkpoints of the 70B hold ~39.8 GB = 37.1 GiB
    assert awq.weights_gib_per_gpu == pytest.approx(37.04, abs=0.01)


def test_activation_follows_the_step_budget_and_graphs_follow_capture_sizes() -> None:
    # Few sampled rows: the forward's peak, linear in the step's tokens, dominates.
    small = plan_memory(memory_inputs("llama-3.1-8b", max_num_batched_tokens=2048, max_num_seqs=16))
    large = plan_memory(memory_inputs("llama-3.1-8b", max_num_batched_tokens=16384, max_num_seqs=16))
    assert large.terms.activation / small.terms.activation == pytest.approx(8)
    # Many sampled rows of a large vocabulary: their bfloat16 logits, twice (a batch mixing greedy and
    # random rows gathers the random ones for the race kernel), dominate a small step: the final hidden
    # states and those.
    many_rows = plan_memory(memory_inputs("llama-3.1-8b", max_num_batched_tokens=2048, max_num_seqs=1024))
    assert many_rows.terms.activation == 2048 * 4096 * 2 + 2 * 1024 * 128256 * 2
    eager = plan_memory(memory_inputs("llama-3.1-8b", cudagraph_capture_sizes=()))
    assert eager.terms.cuda_graphs == 0
    few = plan_memory(memory_inputs("llama-3.1-8b", cudagraph_capture_sizes=(1, 2, 4, 8)))
    assert 0 < few.terms.cuda_graphs < plan_memory(memory_inputs("llama-3.1-8b")).terms.cuda_graphs


def test_num_gpu_blocks_override_wins() -> None:
    plan = plan_memory(memory_inputs("llama-3.1-8b", num_gpu_blocks_override=1000))
    assert plan.num_kv_blocks == 1000
    assert plan.kv_cache_tokens == 999 * 16


def test_cpu_plan_uses_the_fixed_cpu_kv_space() -> None:
    info = model_info("qwen3-0.6b")
    cpu = dataclasses.replace(memory_inputs("qwen3-0.6b").device, kind="cpu", name="CPU")
    plan = plan_memory(memory_inputs("qwen3-0.6b", device=cpu, dtype="float32", cpu_kv_cache_space_gib=2.0))
    assert plan.kv_cache_bytes == pytest.approx(2 * GiB, abs=plan.block_bytes)
    assert plan.terms.weights == info.weights.total_params * 4
    assert plan.terms.cuda_graphs == 0


def test_measured_terms_size_the_kv_cache_and_compare_with_the_plan() -> None:
    inputs = memory_inputs("llama-3.1-8b")
    planned = plan_memory(inputs)
    measured_terms = MemoryTerms(
        weights=planned.terms.weights,
        activation=planned.terms.activation + GiB,
        cuda_graphs=planned.terms.cuda_graphs,
        runtime_overhead=planned.terms.runtime_overhead,
    )
    measured = plan_memory(inputs, measured_terms)
    assert measured.estimated == planned.terms
    assert planned.kv_cache_bytes - measured.kv_cache_bytes == pytest.approx(GiB, abs=planned.block_bytes)
    lines = planned_vs_measured(planned, measured)
    assert lines[0].startswith("weights: planned 14.96 GiB, measured 14.96 GiB (+0.0%)")
    assert "activation peak: planned 0.78 GiB, measured 1.78 GiB (-56.1%)" in lines[1]
    assert lines[-1].startswith(f"KV cache tokens: planned {planned.kv_cache_tokens:,}")


def test_bad_inputs_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"max_num_seqs=0 is below the minimum 1: set --max-num-seqs"):
        plan_memory(memory_inputs("llama-3.1-8b", max_num_seqs=0))
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int4' is not one of auto, fp8"):
        plan_memory(memory_inputs("llama-3.1-8b", kv_cache_dtype="int4"))
    with pytest.raises(
        ValueError, match=r"quantization='int3' is not a method the planner knows: use one of"
    ):
        plan_memory(memory_inputs("llama-3.1-8b", quantization="int3"))
