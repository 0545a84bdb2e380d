"""Tensor parallel on the CPU (gloo, one process per rank): the engine at TP 2 gives TP 1's greedy
tokens; a rank that dies stops the engine with its rank named, and nothing hangs."""

from __future__ import annotations

import multiprocessing.connection
import os
import signal
import time

import pytest

from fitserve import SamplingParams
from fitserve.worker.rank_failure import RankFailedError
from tests.unit.test_engine_vs_hf import make_llm, save_tiny_model

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [3]]


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def tiny_folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny_model(folder, request.param)
    return folder


def _greedy(llm, **params):
    sampling = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **params)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sampling, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def test_tp2_greedy_equals_tp1(tiny_folder):
    one = make_llm(tiny_folder)
    expected = _greedy(one, logprobs=3)
    two = make_llm(tiny_folder, tensor_parallel_size=2, max_num_batched_tokens=8, max_num_seqs=2)
    try:
        got = _greedy(two, logprobs=3)
    finally:
        two.engine.shutdown()
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, ours), (_, theirs) in zip(got, expected):
        for position_ours, position_theirs in zip(ours, theirs):
            for token_id, entry in position_theirs.items():
                assert abs(position_ours[token_id].logprob - entry.logprob) < 1e-4


def test_tp2_with_penalties_equals_tp1(tiny_folder):
    """Penalties read the exact outputs: each step's sampling is queued after the last step's tokens are
    taken (its forward, and the LM head's gather across ranks, before)."""
    penalties = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.2}
    expected = _greedy(make_llm(tiny_folder), **penalties)
    two = make_llm(tiny_folder, tensor_parallel_size=2)
    try:
        got = _greedy(two, **penalties)
    finally:
        two.engine.shutdown()
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]


def test_a_dead_rank_stops_the_engine_naming_it(tiny_folder):
    llm = make_llm(tiny_folder, tensor_parallel_size=2)
    rank = llm.engine.executor.ranks[0]
    os.kill(rank.process.pid, signal.SIGKILL)
    multiprocessing.connection.wait([rank.process.sentinel], timeout=10)
    started = time.perf_counter()
    expected = r"tensor-parallel rank 1 failed: its process exited \(exit code -9: killed by signal 9\)"
    with pytest.raises(RankFailedError, match=expected):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8), use_tqdm=False)
    assert time.perf_counter() - started < 30
    llm.engine.shutdown()


def test_tp4_replicates_the_kv_heads_and_gives_tp1_tokens(tmp_path_factory):
    # 4 ranks, 2 KV heads: each KV head is held by two ranks (layers/tp_shards.py)
    folder = tmp_path_factory.mktemp("tp4-llama")
    save_tiny_model(folder, "LlamaForCausalLM")
    expected = _greedy(make_llm(folder))
    four = make_llm(folder, tensor_parallel_size=4)
    try:
        assert four.engine.config.rank_kv_layers[0].num_kv_heads == 1
        got = _greedy(four)
    finally:
        four.engine.shutdown()
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]


def test_a_rank_that_dies_while_starting_fails_the_start_naming_it(tiny_folder):
    import multiprocessing
    import threading

    outcome: list[BaseException | None] = []

    def start() -> None:
        try:
            make_llm(tiny_folder, tensor_parallel_size=2).engine.shutdown()
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            outcome.append(error)

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    deadline = time.monotonic() + 30
    ranks: list = []
    while not ranks and time.monotonic() < deadline:
        ranks = [p for p in multiprocessing.active_children() if p.name == "fitserve-rank-1"]
        time.sleep(0.01)
    assert ranks, "the rank process never started"
    os.kill(ranks[0].pid, signal.SIGKILL)
    starter.join(timeout=60)
    assert not starter.is_alive(), "the start hung after its rank died"
    assert isinstance(outcome[0], RankFailedError)
    assert "tensor-parallel rank 1 failed: its process exited (exit code -9" in str(outcome[0])


def test_a_bad_collective_timeout_is_refused_naming_the_variable(monkeypatch):
    from fitserve.distributed.parallel_state import TIMEOUT_ENV, collective_timeout_s

    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=r"FITSERVE_DIST_TIMEOUT_S='soon' is not a number of seconds"):
        collective_timeout_s()
    monkeypatch.setenv(TIMEOUT_ENV, "0")
    with pytest.raises(ValueError, match=r"FITSERVE_DIST_TIMEOUT_S='0' must be positive"):
        collective_timeout_s()
