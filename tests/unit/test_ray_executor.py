"""--distributed-executor-backend ray on the CPU (gloo, a local Ray cluster of 4 CPUs shared by the
module): ranks 1.. in Ray actors give the mp backend's tokens at TP 2 and TP 2 x PP 2; an actor that dies
stops the engine naming its rank; shutdown gives the cluster its CPUs back; a cluster too small is
refused with the numbers; without Ray the flag is refused naming the fix; the plan takes the GPUs this
machine lacks as its first; a GPU Ray names is found among the visible ones."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import pytest

from fitserve import SamplingParams
from fitserve.args import EngineArgs
from fitserve.args_support import refuse_unsupported
from fitserve.config import DeviceConfig
from fitserve.worker.rank_failure import RankFailedError
from tests.model_folders import save_with_tokenizer
from tests.unit.model_helpers import build_hf_model, tiny_hf_config
from tests.unit.test_engine_vs_hf import make_llm

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [3]]
CLUSTER_CPUS = 4


@pytest.fixture(scope="module")
def cluster():
    """One local cluster for the module (it takes seconds to start); the engine joins it."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=CLUSTER_CPUS, include_dashboard=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    """A 4-layer Llama: 2 layers per pipeline stage."""
    model = build_hf_model(tiny_hf_config("LlamaForCausalLM", num_hidden_layers=4), seed=3)
    return save_with_tokenizer(model, tmp_path_factory.mktemp("llama4-ray"))


def _greedy(llm) -> list:
    sampling = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sampling, use_tqdm=False)
    return [o.outputs[0] for o in outputs]


def _assert_same(got, expected) -> None:
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for ours, theirs in zip(got, expected):
        for position_ours, position_theirs in zip(ours.logprobs, theirs.logprobs):
            for token_id, entry in position_theirs.items():
                assert abs(position_ours[token_id].logprob - entry.logprob) < 1e-4


def _free_cpus_back(cluster, timeout_s: float = 10.0) -> float:
    """The cluster's free CPUs once they settle back to all of them (Ray reports them a moment late)."""
    deadline = time.monotonic() + timeout_s
    free = cluster.available_resources().get("CPU", 0)
    while free < CLUSTER_CPUS and time.monotonic() < deadline:
        time.sleep(0.1)
        free = cluster.available_resources().get("CPU", 0)
    return free


def test_tp2_and_tp2_x_pp2_in_ray_actors_give_the_tokens_of_one_rank(cluster, llama_folder):
    expected = _greedy(make_llm(llama_folder))
    two = make_llm(llama_folder, tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        executor = two.engine.executor
        assert type(executor.ranks[0]).__name__ == "RayRank"
        assert executor.ranks[0].label == "tensor-parallel rank 1"
        assert not executor.ranks[0]._placement.address.startswith("tcp://127.")  # the node's IP
        assert cluster.available_resources().get("CPU", 0) == CLUSTER_CPUS - 2  # rank 0's bundle, rank 1's
        _assert_same(_greedy(two), expected)
    finally:
        two.engine.shutdown()
    assert _free_cpus_back(cluster) == CLUSTER_CPUS  # actors killed, placement group removed
    assert all(group["state"] == "REMOVED" for group in cluster.util.placement_group_table().values())

    four = make_llm(
        llama_folder, tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="ray"
    )
    try:
        assert [rank.label for rank in four.engine.executor.ranks] == [
            "rank 1 (pipeline stage 0, tensor-parallel rank 1)",
            "rank 2 (pipeline stage 1, tensor-parallel rank 0)",
            "rank 3 (pipeline stage 1, tensor-parallel rank 1)",
        ]
        _assert_same(_greedy(four), expected)
    finally:
        four.engine.shutdown()
    assert _free_cpus_back(cluster) == CLUSTER_CPUS


def test_a_killed_actor_stops_the_engine_naming_its_rank(cluster, llama_folder):
    llm = make_llm(llama_folder, tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        cluster.kill(llm.engine.executor.ranks[0].actor)
        started = time.perf_counter()
        expected = r"tensor-parallel rank 1 failed: its Ray actor \(pid \d+ on [\d.]+\) died: .*ray\.kill"
        with pytest.raises(RankFailedError, match=expected):
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8), use_tqdm=False)
        assert time.perf_counter() - started < 30
    finally:
        llm.engine.shutdown()
    assert _free_cpus_back(cluster) == CLUSTER_CPUS


def test_a_cluster_too_small_is_refused_with_the_numbers(cluster, llama_folder, monkeypatch):
    from fitserve.worker.ray_ranks import PLACEMENT_TIMEOUT_ENV, RayPlacement

    monkeypatch.setenv(PLACEMENT_TIMEOUT_ENV, "1")
    with pytest.raises(RuntimeError, match=r"did not reserve 2 stage\(s\) of 4 ranks \(1 CPU each.* in 1 s"):
        make_llm(
            llama_folder, tensor_parallel_size=4, pipeline_parallel_size=2, distributed_executor_backend="ray"
        )
    assert _free_cpus_back(cluster) == CLUSTER_CPUS  # the pending placement groups were given back
    config = make_llm(llama_folder).engine.config
    on_gpus = dataclasses.replace(
        config,
        device=DeviceConfig("cuda"),
        parallel=dataclasses.replace(
            config.parallel, tensor_parallel_size=2, distributed_executor_backend="ray"
        ),
    )
    with pytest.raises(
        RuntimeError, match=r"^--distributed-executor-backend ray: 2 ranks need 2 GPUs, the Ray "
    ):
        RayPlacement(on_gpus, 2)


def test_without_ray_the_flag_is_refused_naming_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if it were not installed
    with pytest.raises(ValueError, match=r'needs Ray, which is not installed: pip install "fitserve\[ray\]"'):
        refuse_unsupported(EngineArgs(tensor_parallel_size=2, distributed_executor_backend="ray"))
    refuse_unsupported(EngineArgs(tensor_parallel_size=2, distributed_executor_backend="mp"))

    from fitserve.distributed.ray_cluster import import_ray

    with pytest.raises(RuntimeError, match=r'pip install "fitserve\[ray\]" \(or pip install ray\)'):
        import_ray()


def test_the_plan_under_ray_takes_the_ranks_this_machine_lacks_as_its_first_gpu():
    from fitserve.planner.fit_errors import PlanError, check_devices
    from fitserve.planner.hardware import DeviceSpec, GiB
    from tests.unit.planner_helpers import model_info

    shape = model_info("qwen3-0.6b").shape
    local = (DeviceSpec("cuda", 0, "NVIDIA H100 80GB HBM3", 80 * GiB, 79 * GiB, (9, 0)),)
    args = EngineArgs(tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="ray")
    assert check_devices(args, local, shape) == [local[0]] * 4  # the cluster's GPUs are counted at start
    with pytest.raises(PlanError, match=r"needs 4 GPUs, torch sees 1"):  # mp: this machine's GPUs only
        check_devices(dataclasses.replace(args, distributed_executor_backend="mp"), local, shape)


def test_a_gpu_ray_names_is_found_among_the_visible_ones(monkeypatch):
    pytest.importorskip("ray")
    from fitserve.worker.ray_ranks import local_device_index

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert local_device_index("3") == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert local_device_index("6") == 1
    with pytest.raises(
        RuntimeError, match=r"GPU 2, which this process does not see \(CUDA_VISIBLE_DEVICES=4,6\)"
    ):
        local_device_index("2")
