"""Whether a tensor-parallel group uses the custom all-reduce (distributed/custom_all_reduce.py): one answer
for every rank, with the reason named, decided over a real gloo group of CPU processes whose host names and
GPU peer access are set per case; `--disable-custom-all-reduce` reaching the engine's config; the CPU
group running without it. The kernels themselves: tests/gpu/test_custom_all_reduce.py (two GPUs) and
tests/unit/test_kernel_targets.py (compiled for every GPU target)."""

from __future__ import annotations

import pytest
import torch

from fitserve.args import EngineArgs
from fitserve.distributed.custom_all_reduce import _why_not
from fitserve.planner.fit import auto_fit
from fitserve.planner.hardware import parse_assume_gpus
from fitserve.planner.model_info import inspect_model
from fitserve.planner.resolve import engine_config_from_fit
from tests.unit.planner_helpers import fixture_path
from tests.unit.tp_helpers import run_ranks


def _decide(
    rank: int,
    hosts: list[str],
    blocked: list[tuple[int, int]],
    own_gpu_only: bool = False,
    set_up_before: tuple[int, ...] = (),
) -> str | None:
    import socket

    from fitserve.distributed import custom_all_reduce
    from fitserve.distributed.parallel_state import tp

    # this process is rank `rank` of a machine whose GPU `rank` reaches the others but `blocked` pairs;
    # own_gpu_only: each rank sees its GPU alone, as cuda:0 (a Ray actor's CUDA_VISIBLE_DEVICES)
    socket.gethostname = lambda: hosts[rank]
    torch.cuda.device_count = lambda: 1 if own_gpu_only else len(hosts)
    torch.cuda.can_device_access_peer = lambda a, b: (a, b) not in blocked
    # set_up_before: ranks whose process set up symmetric memory for an earlier engine (rank 0 lives in
    # the engine's process; the others are started afresh for each engine)
    custom_all_reduce._set_up_in_this_process = rank in set_up_before
    assert tp().custom_all_reduce is None  # a gloo group never sets it up
    return _why_not(tp().group, rank, len(hosts), torch.device("cuda", 0 if own_gpu_only else rank))


def test_two_peer_gpus_of_one_machine_use_it():
    assert run_ranks(_decide, 2, ["node", "node"], []) == [None, None]


def test_ranks_on_two_machines_turn_it_off_on_both():
    reasons = run_ranks(_decide, 2, ["node-a", "node-b"], [])
    assert reasons == ["the ranks run on more than one machine (rank 0)"] * 2


def test_one_rank_without_peer_access_turns_it_off_for_all_and_is_named():
    reasons = run_ranks(_decide, 2, ["node", "node"], [(1, 0)])
    assert reasons == ["GPU 1 has no peer access to GPU 0 (rank 1)"] * 2


def test_ranks_that_each_see_one_gpu_turn_it_off():
    reasons = run_ranks(_decide, 2, ["node", "node"], [], True)
    assert reasons == ["the ranks see different sets of GPUs (rank 0)"] * 2


def test_a_second_engine_in_the_first_ranks_process_turns_it_off_for_all():
    # torch numbers symmetric-memory exchanges per process: the engine process's second setup would wait
    # for keys the fresh ranks never write (it hung on two H200s), so that engine uses NCCL
    reasons = run_ranks(_decide, 2, ["node", "node"], [], False, (0,))
    assert len(set(reasons)) == 1
    assert reasons[0].startswith("an earlier engine of this process set up torch's symmetric memory")
    assert reasons[0].endswith("(rank 0)")
    assert run_ranks(_decide, 2, ["node", "node"], [], False, ()) == [None, None]


def test_off_the_gpu_and_past_eight_ranks_without_a_collective():
    assert _why_not(None, 0, 2, torch.device("cpu")) == "not on CUDA"
    assert _why_not(None, 0, 9, torch.device("cuda", 0)) == "9 ranks (it takes 2 to 8)"


@pytest.mark.parametrize("disable", [False, True])
def test_the_flag_reaches_the_engine_config(disable: bool):
    model = inspect_model(fixture_path("qwen3-8b"), load_format="dummy")
    args = EngineArgs(model=fixture_path("qwen3-8b"), load_format="dummy", disable_custom_all_reduce=disable)
    config = engine_config_from_fit(args, auto_fit(model, args, parse_assume_gpus("2x16@8.9")))
    assert config.parallel.tensor_parallel_size == 2
    assert config.parallel.disable_custom_all_reduce is disable


def test_only_the_graph_runners_forwards_send_sums_to_it():
    """Eager steps keep NCCL; the graph runners' warm-up and capture forwards (graph_forwards) take the
    custom all-reduce, nested or not, and leave it when done."""
    from fitserve.distributed import collectives

    group_custom = object()  # what tp().custom_all_reduce holds on a GPU group that runs it
    assert collectives._in_graph(group_custom) is None
    assert collectives._in_graph(None) is None
    with collectives.graph_forwards():
        assert collectives._in_graph(group_custom) is group_custom
        with collectives.graph_forwards():
            assert collectives._in_graph(group_custom) is group_custom
        assert collectives._in_graph(group_custom) is group_custom
        assert collectives._in_graph(None) is None
    assert collectives._in_graph(group_custom) is None
