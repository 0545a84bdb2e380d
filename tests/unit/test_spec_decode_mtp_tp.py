"""MTP speculation under tensor parallel on the CPU (gloo, one process per rank; worker/draft_steps.py): the
MTP layer split like the target's, every drafter forward on every rank. Greedy output at TP 2 with MTP
equals TP 1 without speculation (all full-attention, a hybrid, an int4 target); the drafts at TP 2 equal
those at TP 1 step for step (eager catch-ups held while a step's sampling is deferred included); the plan
counts the layer per rank; a rank that dies mid-draft stops the engine naming it."""

from __future__ import annotations

import multiprocessing.connection
import os
import signal
import time

import pytest
from safetensors.torch import save_file

from fitserve.worker.rank_failure import RankFailedError
from tests.unit.qwen3_5_helpers import FULL, LIN
from tests.unit.test_engine_vs_hf import make_llm
from tests.unit.test_spec_decode_engine import _generate, _prompts, _token_ids, record_drafts
from tests.unit.test_spec_decode_mtp import (
    HEAD_DIM,
    KV_HEADS,
    _mtp,
    mtp_tensors,
    save_target,
    write_copying_target,
)

K = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_target(tmp_path_factory.mktemp("mtp-tp-target"), [FULL, FULL], mtp_tensors(7))


@pytest.fixture(scope="module")
def copying_folder(tmp_path_factory):
    """test_spec_decode_mtp.py's copying target: layers that add nothing, an MTP layer that copies, so
    the target accepts its drafts."""
    return write_copying_target(tmp_path_factory.mktemp("mtp-tp-copying"))


def _expect_same_output(folder, prompts, max_tokens, **kwargs):
    """TP 2 with MTP against TP 1 without speculation: the same greedy tokens; the TP 2 engine is returned
    (shut down) with its drafter's counters."""
    expected = _token_ids(
        _generate(make_llm(folder, speculative_config={}, **kwargs), prompts, max_tokens=max_tokens)
    )
    two = make_llm(folder, speculative_config=_mtp(K), tensor_parallel_size=2, **kwargs)
    try:
        got = _token_ids(_generate(two, prompts, max_tokens=max_tokens))
    finally:
        two.engine.shutdown()
    assert got == expected
    assert two.engine.speculator.stats.num_draft_tokens > 0
    return two


def test_tp2_greedy_equals_tp1_without_speculation_and_the_plan_counts_a_rank(target):
    from fitserve.args import EngineArgs
    from fitserve.planner.draft_plan import mtp_footprint
    from fitserve.planner.engine_plan import inputs_from_engine_config
    from fitserve.planner.resolve import plan_settings

    folder, _ = target
    two = _expect_same_output(folder, _prompts(4, seed=1), 30)
    drafter = two.engine.speculator.draft
    # the rank's one KV head of two, its share of the layer (fc and the norms whole on every rank)
    assert drafter.kv_bytes_per_token == 2 * (KV_HEADS // 2) * HEAD_DIM * 4
    base = {"model": str(folder), "device": "cpu", "dtype": "float32", "cpu_kv_cache_space": 0.01}
    device = plan_settings(EngineArgs(**base, speculative_config=_mtp(K))).plan.inputs.device
    inputs = inputs_from_engine_config(two.engine.config, device)
    assert inputs.tensor_parallel_size == 2
    footprint = mtp_footprint(inputs, K)
    assert footprint.weight_bytes == drafter.weight_bytes
    assert footprint.kv_elements_per_token == 2 * (KV_HEADS // 2) * HEAD_DIM


@pytest.mark.parametrize("layer", ["random", "copying"])
def test_drafts_at_tp2_equal_drafts_at_tp1(target, copying_folder, layer, monkeypatch):
    """Chunked prefill, steps without drafts, a repetition penalty (a step's sampling deferred after a
    step without drafts) and eager catch-ups every few rows: TP 2 drafts what TP 1 drafts, step for step,
    and accepts as many; some eager catch-ups were held for a deferred sampling and run later. `copying`:
    an MTP layer whose drafts the target accepts (the random one's it refuses)."""
    import fitserve.spec_decode.eagle3.drafter as eagle3

    monkeypatch.setattr(eagle3, "EAGER_ROWS", 4)  # read by the first rank's drafter only
    folder = target[0] if layer == "random" else copying_folder
    kwargs = {"enable_prefix_caching": False, "max_num_batched_tokens": 16, "max_num_seqs": 4}
    prompts = _prompts(3, seed=13)
    runs = []
    for tp in (1, 2):
        llm = make_llm(folder, speculative_config=_mtp(K), tensor_parallel_size=tp, **kwargs)
        speculator = llm.engine.speculator
        drafter = speculator.draft
        wants, calls, held = speculator.wants_drafts, [], []

        def some(running, wants=wants, calls=calls):
            calls.append(1)
            return len(calls) % 4 >= 2 and wants(running)  # two steps without drafts in four

        speculator.wants_drafts = some
        catch_up = drafter._catch_up

        def watching(targets, sample, drafter=drafter, catch_up=catch_up, held=held):
            if drafter._hold_eager and not sample:
                held.append(len(targets))
            return catch_up(targets, sample)

        drafter._catch_up = watching
        records = record_drafts(drafter)
        try:
            outputs = _token_ids(_generate(llm, prompts, max_tokens=20, repetition_penalty=1.2))
        finally:
            llm.engine.shutdown()
        stats = speculator.stats
        runs.append((outputs, records, stats.num_draft_tokens, stats.num_accepted_tokens, held))
    (out1, records1, drafted1, accepted1, _), (out2, records2, drafted2, accepted2, held2) = runs
    assert len(records1) >= 5
    assert records2 == records1
    assert (drafted2, accepted2) == (drafted1, accepted1)
    assert accepted1 > 0 or layer == "random"
    assert out2 == out1
    if layer == "random":  # its drafts refused, speculation pauses: steps without drafts, deferred sampling
        assert held2, "no eager catch-up fell on a deferred sampling: the test no longer covers it"


def test_hybrid_tp2_greedy_equals_tp1_without_speculation(tmp_path):
    folder, _ = save_target(tmp_path, [LIN, LIN, FULL, LIN], mtp_tensors(5))
    _expect_same_output(folder, _prompts(3, seed=9), 20)


def test_int4_target_tp2_greedy_equals_tp1_without_speculation(tmp_path):
    """An int4 (compressed-tensors) target whose MTP layer stays 16-bit, as Qwen3.6-27B-AWQ-INT4's."""
    from tests.quant_checkpoints import QuantSpec
    from tests.unit.qwen3_5_quant_helpers import SIZES, build_model, write_int4

    model = build_model(False, seed=2, layer_types=[FULL, FULL], num_hidden_layers=2, mtp_num_hidden_layers=1)
    write_int4(tmp_path, model, QuantSpec("ct", 32, ignore=("re:.*mtp.*",)))
    hidden, width = SIZES["hidden_size"], SIZES["intermediate_size"]
    save_file(mtp_tensors(3, hidden=hidden, intermediate=width), str(tmp_path / "mtp.safetensors"))
    _expect_same_output(tmp_path, _prompts(2, seed=7), 16)


def test_a_rank_that_dies_mid_draft_stops_the_engine_naming_it(target):
    from fitserve.worker.draft_steps import DraftChannel

    folder, _ = target
    llm = make_llm(folder, speculative_config=_mtp(K), tensor_parallel_size=2)
    drafter = llm.engine.speculator.draft
    rank = llm.engine.executor.ranks[0]
    channel, sent = drafter.channel, []

    def send_then_die(host):
        sent.append(1)
        if len(sent) == 2:  # after the catch-up, before the first recurrent step
            os.kill(rank.process.pid, signal.SIGKILL)
            multiprocessing.connection.wait([rank.process.sentinel], timeout=10)
        channel.send(host)

    drafter.channel = DraftChannel(send_then_die, channel.guard, channel.sampling_pending)
    started = time.perf_counter()
    expected = r"tensor-parallel rank 1 failed: its process exited \(exit code -9: killed by signal 9\)"
    try:
        with pytest.raises(RankFailedError, match=expected):
            _generate(llm, [[5, 6, 7, 8, 9]], max_tokens=12)
        assert len(sent) >= 2
        assert time.perf_counter() - started < 30
    finally:
        llm.engine.shutdown()
