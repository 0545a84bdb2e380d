"""Pipeline parallel on the CPU (gloo, one process per rank): the engine at PP 2 (and TP 2 x PP 2) gives
PP 1's tokens and logprobs, over even and uneven splits; each stage holds only its layers; the plan counts
one stage's weights and KV; the refusals name the value, the limit and the fix; a dead stage stops the
engine with its rank named."""

from __future__ import annotations

import multiprocessing.connection
import os
import signal
import time
from pathlib import Path

import pytest

from fitserve import SamplingParams
from fitserve.args import EngineArgs
from fitserve.args_support import refuse_unsupported
from fitserve.distributed.parallel_state import PipelineParallel, set_pipeline_parallel
from fitserve.distributed.pipeline import PARTITION_ENV, describe_split, stage_layer_ranges
from fitserve.planner.fit import PlanError, auto_fit
from fitserve.planner.fit_parallel import pipeline_refusal
from fitserve.planner.hardware import DeviceSpec, GiB, parse_assume_gpus
from fitserve.planner.kv_memory import stage_kv_bytes_per_token
from fitserve.planner.memory import for_pipeline_stage, plan_memory
from fitserve.planner.memory_estimates import stage_weight_bytes, weight_bytes_per_gpu
from fitserve.planner.memory_inputs import with_settings
from fitserve.worker.rank_failure import RankFailedError
from fitserve.worker.tp_executor import rank_label
from tests.model_folders import save_with_tokenizer
from tests.unit.model_helpers import build_hf_model, tiny_hf_config
from tests.unit.planner_helpers import model_info
from tests.unit.test_engine_vs_hf import make_llm, save_tiny_model

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [3]]


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def tiny_folder(request, tmp_path_factory):
    """2 layers (one per stage); the Qwen2 model ties its LM head to the embedding."""
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny_model(folder, request.param)
    return folder


@pytest.fixture(scope="module")
def five_layer_folder(tmp_path_factory) -> Path:
    """A 5-layer Llama: 3 layers on stage 0, 2 on stage 1."""
    model = build_hf_model(tiny_hf_config("LlamaForCausalLM", num_hidden_layers=5), seed=5)
    return save_with_tokenizer(model, tmp_path_factory.mktemp("llama5"))


def _outputs(llm, **params) -> list:
    params = {"temperature": 0, "max_tokens": 10, "ignore_eos": True, **params}
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(**params), use_tqdm=False
    )
    return [o.outputs[0] for o in outputs], [o.prompt_logprobs for o in outputs]


def _assert_same(got, expected) -> None:
    (ours, our_prompts), (theirs, their_prompts) = got, expected
    assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]
    for one, other in zip(ours, theirs):
        for position_ours, position_theirs in zip(one.logprobs or [], other.logprobs or []):
            for token_id, entry in position_theirs.items():
                assert abs(position_ours[token_id].logprob - entry.logprob) < 1e-4
    for one, other in zip(our_prompts, their_prompts):
        assert (one is None) == (other is None)
        for position_ours, position_theirs in zip(one or [], other or []):
            if position_theirs is None:
                assert position_ours is None
                continue
            for token_id, entry in position_theirs.items():
                assert abs(position_ours[token_id].logprob - entry.logprob) < 1e-4


def _with_engine(llm, work):
    try:
        return work(llm)
    finally:
        llm.engine.shutdown()


# ---- the engine --------------------------------------------------------------------------------------------


def test_pp2_greedy_and_logprobs_equal_pp1(tiny_folder):
    asked = {"logprobs": 3, "prompt_logprobs": 2}
    expected = _outputs(make_llm(tiny_folder), **asked)
    two = make_llm(tiny_folder, pipeline_parallel_size=2, max_num_batched_tokens=8, max_num_seqs=2)
    assert two.engine.executor.ranks[0].label == "rank 1 (pipeline stage 1, tensor-parallel rank 0)"
    runner = two.engine.executor.runner
    assert [cache.numel() > 0 for cache in runner.kv_caches] == [True, False]  # stage 0: layer 0's cache
    assert two.engine.executor.runner.model.lm_head is None
    _assert_same(_with_engine(two, lambda llm: _outputs(llm, **asked)), expected)


def test_an_uneven_split_with_penalties_and_seeded_sampling_equals_pp1(five_layer_folder):
    """Rank 0 samples (seeded generators, penalties over the exact outputs) from the logits the last stage
    sends; chunked prefill sends partial prompts through the stages."""
    asked = {
        "temperature": 1.0,
        "seed": 7,
        "repetition_penalty": 1.3,
        "frequency_penalty": 0.2,
        "logprobs": 2,
    }
    expected = _outputs(make_llm(five_layer_folder, max_num_batched_tokens=6, max_num_seqs=3), **asked)
    two = make_llm(five_layer_folder, pipeline_parallel_size=2, max_num_batched_tokens=6, max_num_seqs=3)
    _assert_same(_with_engine(two, lambda llm: _outputs(llm, **asked)), expected)


def test_tp2_x_pp2_greedy_equals_pp1(five_layer_folder):
    expected = _outputs(make_llm(five_layer_folder), logprobs=2)
    four = make_llm(five_layer_folder, tensor_parallel_size=2, pipeline_parallel_size=2)
    labels = [rank.label for rank in four.engine.executor.ranks]
    assert labels == [
        "rank 1 (pipeline stage 0, tensor-parallel rank 1)",
        "rank 2 (pipeline stage 1, tensor-parallel rank 0)",
        "rank 3 (pipeline stage 1, tensor-parallel rank 1)",
    ]
    _assert_same(_with_engine(four, lambda llm: _outputs(llm, logprobs=2)), expected)


def test_a_dead_stage_stops_the_engine_naming_its_rank(five_layer_folder):
    llm = make_llm(five_layer_folder, pipeline_parallel_size=2)
    rank = llm.engine.executor.ranks[0]
    os.kill(rank.process.pid, signal.SIGKILL)
    multiprocessing.connection.wait([rank.process.sentinel], timeout=10)
    started = time.perf_counter()
    expected = (
        r"rank 1 \(pipeline stage 1, tensor-parallel rank 0\) failed: its process exited "
        r"\(exit code -9: killed by signal 9\)"
    )
    with pytest.raises(RankFailedError, match=expected):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8), use_tqdm=False)
    assert time.perf_counter() - started < 30
    llm.engine.shutdown()


# ---- a stage's model ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_a_stage_builds_only_its_layers(tied):
    from fitserve.models.llama import LlamaForCausalLM

    config = tiny_hf_config("LlamaForCausalLM", num_hidden_layers=5, tie_word_embeddings=tied)
    names = {}
    try:
        for stage in (0, 1):
            set_pipeline_parallel(PipelineParallel(stage, 2, 1))
            names[stage] = {
                name.split(".weight")[0] for name, _ in LlamaForCausalLM(config).named_parameters()
            }
    finally:
        set_pipeline_parallel(PipelineParallel())
    layers = {
        stage: sorted({int(n.split(".")[2]) for n in names[stage] if n.startswith("model.layers.")})
        for stage in names
    }
    assert layers == {0: [0, 1, 2], 1: [3, 4]}
    assert "model.embed_tokens" in names[0] and "lm_head" not in names[0] and "model.norm" not in names[0]
    assert "model.norm" in names[1]
    # a tied head reads the embedding, which the last stage then holds; an untied one is its own matrix
    assert ("model.embed_tokens" in names[1]) == tied
    assert ("lm_head" in names[1]) == (not tied)


def test_the_split_is_vllms_and_the_env_overrides_it(monkeypatch):
    assert stage_layer_ranges(32, 2) == [(0, 16), (16, 32)]
    assert stage_layer_ranges(5, 2) == [(0, 3), (3, 5)]
    # the leftover layers go to the stages before the last, from the second-to-last back
    assert stage_layer_ranges(10, 4) == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert describe_split(32, 2) == "layers 0-15 on stage 0, 16-31 on stage 1"
    monkeypatch.setenv(PARTITION_ENV, "4,1")
    assert stage_layer_ranges(5, 2) == [(0, 4), (4, 5)]
    monkeypatch.setenv(PARTITION_ENV, "3,3")
    with pytest.raises(ValueError, match=r"must give 2 layer counts .* adding up to the model's 5 layers"):
        stage_layer_ranges(5, 2)
    with pytest.raises(
        ValueError, match=r"pipeline_parallel_size=6 is more than the model's 5 decoder layers"
    ):
        monkeypatch.delenv(PARTITION_ENV)
        stage_layer_ranges(5, 6)


# ---- the plan ----------------------------------------------------------------------------------------------


CPU = DeviceSpec("cpu", 0, "CPU (2 cores, 16.0 GiB RAM)", 16 * GiB, 12 * GiB)


def _plan_inputs(name: str, gpus: str = "1x80@9.0", **args: object):
    devices = [CPU] if gpus == "cpu" else parse_assume_gpus(gpus)
    return auto_fit(model_info(name), EngineArgs(**args), devices).plan.inputs  # type: ignore[arg-type]


def test_the_plan_counts_one_stages_weights_and_kv():
    one = _plan_inputs("llama-3.1-8b", max_model_len=8192)
    two = with_settings(one, pipeline_parallel_size=2)
    whole, halves = plan_memory(one), plan_memory(two)
    # stage 0: 16 layers and the embedding; stage 1: 16 layers, the final norm and the (untied) LM head
    stages = [stage_weight_bytes(two, stage) for stage in (0, 1)]
    assert abs(sum(stages) - weight_bytes_per_gpu(one)) <= 64
    assert halves.terms.weights == max(stages) < 0.6 * whole.terms.weights
    assert (
        stage_kv_bytes_per_token(two, 0) == stage_kv_bytes_per_token(two, 1) == whole.kv_bytes_per_token // 2
    )
    assert halves.kv_bytes_per_token == whole.kv_bytes_per_token // 2
    assert halves.num_kv_blocks > 2 * whole.num_kv_blocks  # half the KV per token, and room left by weights
    assert halves.terms.cuda_graphs == 0  # stages run eagerly
    (note,) = [n for n in halves.notes if n.startswith("pipeline parallel")]
    assert "layers 0-15 on stage 0, 16-31 on stage 1" in note


def test_an_uneven_plan_is_the_fullest_stages():
    one = _plan_inputs("qwen3-0.6b", max_model_len=4096)
    three = with_settings(one, pipeline_parallel_size=3)
    assert stage_layer_ranges(28, 3) == [(0, 9), (9, 19), (19, 28)]
    plan = plan_memory(three)
    # the middle stage has 10 of the 28 layers' KV (and no embedding): its blocks bound every stage's pool
    per_token = plan_memory(one).kv_bytes_per_token
    assert plan.kv_bytes_per_token == stage_kv_bytes_per_token(three, 1) == per_token * 10 // 28
    assert stage_kv_bytes_per_token(three, 0) == stage_kv_bytes_per_token(three, 2) == per_token * 9 // 28
    assert plan.terms.weights == stage_weight_bytes(three, 1) < stage_weight_bytes(three, 2)
    assert plan.num_kv_blocks == plan.free_for_kv_bytes // plan.block_bytes
    assert any("stage 1, the one with room for the fewest KV blocks" in n for n in plan.notes)


def test_a_stage_resizes_its_gpu_pool_for_its_own_layers():
    """The engine sizes the pool over every layer (platforms.py), then each stage's rank re-sizes it for
    its own layers' KV: on a GPU the memory left holds more blocks, on the CPU the pool keeps its tokens."""
    gpu = plan_memory(_plan_inputs("llama-3.1-8b", max_model_len=8192))
    half = for_pipeline_stage(gpu, gpu.kv_bytes_per_token // 2)
    assert half.num_kv_blocks == gpu.free_for_kv_bytes // (gpu.block_bytes // 2) >= 2 * gpu.num_kv_blocks
    assert half.kv_cache_bytes == half.num_kv_blocks * half.block_bytes
    cpu = plan_memory(_plan_inputs("qwen3-0.6b", "cpu", max_model_len=4096))
    assert for_pipeline_stage(cpu, cpu.kv_bytes_per_token // 2).num_kv_blocks == cpu.num_kv_blocks


# ---- refusals ----------------------------------------------------------------------------------------------


def test_more_ranks_than_gpus_is_refused_with_the_fix():
    with pytest.raises(PlanError) as error:
        auto_fit(
            model_info("llama-3.1-8b"),
            EngineArgs(tensor_parallel_size=2, pipeline_parallel_size=2),
            parse_assume_gpus("2x80@9.0"),
        )
    assert str(error.value) == (
        "tensor_parallel_size=2 x pipeline_parallel_size=2 needs 4 GPUs, the plan has 2: set "
        "--pipeline-parallel-size 1, or plan for more with --assume-gpus 4x80"
    )
    fits = auto_fit(
        model_info("llama-3.1-8b"),
        EngineArgs(tensor_parallel_size=2, pipeline_parallel_size=2),
        parse_assume_gpus("4x80@9.0"),
    )
    assert len(fits.devices) == 4


def test_stages_on_gpus_that_differ_are_refused():
    with pytest.raises(PlanError) as error:
        auto_fit(
            model_info("llama-3.1-8b"),
            EngineArgs(pipeline_parallel_size=2),
            parse_assume_gpus("1x80@9.0,1x40@9.0"),
        )
    assert str(error.value).startswith(
        "tensor_parallel_size=1 x pipeline_parallel_size=2 needs 2 alike GPUs (each rank is planned alike), "
        "but GPU 0 "
    )
    assert str(error.value).endswith("plan for alike GPUs with --assume-gpus 2x80")


def test_more_stages_than_layers_is_refused():
    with pytest.raises(
        PlanError,
        match=r"^pipeline_parallel_size=29 is more than the model's 28 decoder layers: "
        r"set --pipeline-parallel-size 28 or less",
    ):
        auto_fit(
            model_info("qwen3-0.6b"), EngineArgs(pipeline_parallel_size=29), parse_assume_gpus("32x80@9.0")
        )


@pytest.mark.parametrize("model_type", ["gemma4_text", "qwen3_5_text", "qwen3_5_moe"])
def test_families_not_built_in_stages_are_refused(model_type):
    refusal = pipeline_refusal(model_type, 24, 2)
    assert refusal is not None and refusal.startswith("pipeline_parallel_size=2 does not run ")
    assert refusal.endswith(
        "yet: set --pipeline-parallel-size 1 and split it with --tensor-parallel-size; pipeline parallel "
        "runs the Llama, Mistral, Qwen2 and Qwen3 families"
    )
    assert pipeline_refusal("llama", 24, 2) is None and pipeline_refusal(model_type, 24, 1) is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            dict(distributed_executor_backend="external_launcher"),
            "not supported yet: --distributed-executor-backend external_launcher (drop it or set "
            "--distributed-executor-backend mp ",
        ),
        (dict(distributed_executor_backend="uni"), "not supported yet: --distributed-executor-backend uni"),
        (
            dict(enable_expert_parallel=True),
            "not supported yet: --pipeline-parallel-size 2 with --enable-expert-parallel",
        ),
        (dict(cpu_offload_gb=4), "not supported yet: --pipeline-parallel-size 2 with --cpu-offload-gb 4"),
        (
            dict(data_parallel_size=2),
            "not supported yet: --pipeline-parallel-size 2 with --data-parallel-size 2",
        ),
        (
            dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
            "not supported yet: --pipeline-parallel-size 2 with --speculative-config (drop "
            "--speculative-config",
        ),
    ],
)
def test_what_pipeline_parallel_does_not_combine_with_is_refused(args, message):
    with pytest.raises(ValueError) as error:
        refuse_unsupported(EngineArgs(pipeline_parallel_size=2, **args))
    assert str(error.value).startswith(message)
    assert str(error.value).endswith("set --pipeline-parallel-size 1)") or "executor-backend" in message
    refuse_unsupported(EngineArgs(pipeline_parallel_size=2, distributed_executor_backend="mp"))


def test_the_executor_checks_a_config_built_past_the_planner(five_layer_folder):
    import dataclasses

    from fitserve.config import ParallelConfig
    from fitserve.planner.resolve import create_engine_config
    from fitserve.worker.pipeline_support import check_pipeline_parallel

    config = create_engine_config(EngineArgs(model=str(five_layer_folder), pipeline_parallel_size=2))
    check_pipeline_parallel(config)  # the planner let it through: so does the executor
    six = dataclasses.replace(config, parallel=ParallelConfig(1, 6))
    with pytest.raises(
        ValueError, match=r"pipeline_parallel_size=6 is more than the model's 5 decoder layers"
    ):
        check_pipeline_parallel(six)
    offload = dataclasses.replace(config, model=dataclasses.replace(config.model, cpu_offload_gb=2.0))
    with pytest.raises(
        ValueError, match=r"^not supported yet: --pipeline-parallel-size 2 with --cpu-offload-gb 2 "
    ):
        check_pipeline_parallel(offload)


def test_rank_labels():
    assert rank_label(1, 2, 1) == "tensor-parallel rank 1"
    assert rank_label(3, 2, 2) == "rank 3 (pipeline stage 1, tensor-parallel rank 1)"
