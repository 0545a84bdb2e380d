"""--data-parallel-size: which GPUs each replica sees, which replica takes a request, the merged stats."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fitserve.engine.async_engine import EngineUnavailableError
from fitserve.engine.data_parallel import DataParallelEngine, merge_stats, replica_visible_devices
from fitserve.engine.engine import EngineStats


def test_replicas_take_consecutive_groups_of_the_visible_gpus():
    assert replica_visible_devices(2, 2, ["0", "1", "2", "3"]) == ["0,1", "2,3"]
    assert replica_visible_devices(2, 1, ["4", "6", "7"]) == ["4", "6"]


def test_too_few_gpus_for_the_replicas_is_refused_with_the_numbers():
    with pytest.raises(ValueError) as error:
        replica_visible_devices(2, 2, ["0", "1", "2"])
    assert str(error.value) == (
        "data_parallel_size=2 x 2 GPU(s) per replica needs 4 GPUs, 3 are visible: lower --data-parallel-size "
        "or --tensor-parallel-size, or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
    )


def _replica(in_flight: int, healthy: bool = True) -> SimpleNamespace:
    return SimpleNamespace(
        engine=None,
        tokenizer=None,
        config=None,
        log_stats=False,
        observers=[],
        is_healthy=healthy,
        num_in_flight=in_flight,
    )


def test_a_request_goes_to_the_least_loaded_healthy_replica():
    busy, idle, dead = _replica(5), _replica(2), _replica(0, healthy=False)
    engine = DataParallelEngine([busy, idle, dead])  # type: ignore[list-item]
    assert engine.pick() is idle
    assert not engine.is_healthy  # one stopped replica: the server answers 503
    assert engine.num_in_flight == 7
    assert busy.observers is idle.observers is engine.observers  # one list of observers for all


def test_no_healthy_replica_is_an_unavailable_engine():
    engine = DataParallelEngine([_replica(0, healthy=False)])  # type: ignore[list-item]
    with pytest.raises(EngineUnavailableError, match="every engine replica has stopped"):
        engine.pick()


def _stats(running: int, usage: float, blocks: int, counts: tuple[int, ...]) -> EngineStats:
    return EngineStats(
        num_running=running,
        num_waiting=1,
        kv_cache_usage=usage,
        prefix_cache_queries=10,
        prefix_cache_hits=4,
        num_prompt_tokens_total=100,
        num_generation_tokens_total=50,
        num_preemptions=0,
        num_kv_blocks=blocks,
        block_size=16,
        iteration_tokens_counts=counts,
        iteration_tokens_sum=7,
    )


def test_merged_stats_sum_the_counts_and_weigh_usage_by_blocks():
    merged = merge_stats([_stats(3, 0.5, 100, (1, 2)), _stats(1, 0.2, 300, (0, 5))])
    assert (merged.num_running, merged.num_waiting, merged.num_kv_blocks) == (4, 2, 400)
    assert merged.kv_cache_usage == pytest.approx((0.5 * 100 + 0.2 * 300) / 400)
    assert merged.iteration_tokens_counts == (1, 7)
    assert (merged.prefix_cache_hits, merged.num_generation_tokens_total, merged.block_size) == (8, 100, 16)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            dict(pipeline_parallel_size=2),
            "not supported yet: --pipeline-parallel-size 2 with --data-parallel-size 2 (set "
            "--data-parallel-size 1 (each replica would need its own 2 stages), or set "
            "--pipeline-parallel-size 1)",
        ),
        (
            dict(tensor_parallel_size=2, distributed_executor_backend="ray"),
            "not supported yet: --distributed-executor-backend ray with --data-parallel-size 2 (drop "
            "--distributed-executor-backend ray (the replicas' ranks run as processes of this host), or set "
            "--data-parallel-size 1)",
        ),
    ],
)
def test_serve_refuses_what_replicas_cannot_run_before_any_starts(args, message):
    """`serve` starts replicas of data_parallel_size 1, so their own checks never see N: create_replicas
    checks the arguments as given first."""
    from fitserve.args import EngineArgs
    from fitserve.server.api_server import create_replicas

    with pytest.raises(ValueError) as error:
        create_replicas(EngineArgs(model="unused", data_parallel_size=2, **args))
    assert str(error.value) == message
