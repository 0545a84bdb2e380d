"""The engine's cheaper host paths of a decode step (issue 27) give what the general paths give: the one-token
rows of build_host_inputs, the sampling rows kept across steps, the outputs' wire tuples."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import numpy as np
import pytest

from fitserve import LLM, SamplingParams
from fitserve.core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from fitserve.core.request import Request
from fitserve.core.scheduler import ScheduledRequest
from fitserve.engine.output_deltas import (
    CHOICE_FIELDS,
    METRICS_FIELDS,
    OUTPUT_FIELDS,
    OutputDecoder,
    OutputEncoder,
)
from fitserve.worker.block_table_rows import BlockTableRows
from fitserve.worker.step_inputs import _rows, build_host_inputs
from tests.unit.test_engine_vs_hf import save_tiny_model

BLOCK_SIZE = 4


def _request(request_id: str, prompt_len: int, outputs: int, prompt_logprobs: int | None = None) -> Request:
    params = SamplingParams(max_tokens=50, prompt_logprobs=prompt_logprobs)
    prompt = [(7 * i + len(request_id)) % 200 + 1 for i in range(prompt_len)]
    request = Request(request_id, request_id, 0, prompt, params, frozenset())
    for t in range(outputs):
        request.append_output_token(100 + t)
    return request


def _one_token_step() -> tuple[list[ScheduledRequest], dict[str, int]]:
    """A step of one-token rows of every kind: a known token, a token in flight, a prompt position with
    prompt logprobs, verify rows (the first known, the others drafts), one that does not sample."""
    known = _request("known", 9, 2)  # computes its last known token (position 10)
    flight = _request("flight", 13, 3)  # its token at position 16 is still in flight
    prompt = _request("prompt", 6, 0, prompt_logprobs=2)  # one prompt token at a time (position 3)
    verify = _request("verify", 5, 1)
    items = [
        ScheduledRequest(known, 10, 1, [3, 8, 1], True),
        ScheduledRequest(flight, 16, 1, [9, 2, 5, 6, 11], True),
        ScheduledRequest(prompt, 3, 1, [4, 12], False),
        ScheduledRequest(verify, 5, 1, [7, 10], True),
        ScheduledRequest(verify, 6, 1, [7, 10], True, draft_token_ids=(41,)),
        ScheduledRequest(verify, 7, 1, [7, 10], True, draft_token_ids=(41, 42)),
    ]
    return items, {"flight": 5}


def test_one_token_rows_equal_the_general_rows() -> None:
    items, in_flight = _one_token_step()
    fast = _rows(items, BLOCK_SIZE, BlockTableRows(8, initial_rows=2), in_flight.__getitem__, one_token=True)
    general = _rows(items, BLOCK_SIZE, BlockTableRows(8, initial_rows=2), in_flight.__getitem__)
    for got, want in zip(fast, general, strict=True):
        if isinstance(want, np.ndarray):
            assert got.dtype == want.dtype and np.array_equal(got, want)
        else:
            assert got == want
    input_ids, positions, slots = fast[:3]
    assert input_ids == [
        items[0].request.all_token_ids[10],
        -1,
        items[2].request.all_token_ids[3],
        100,
        41,
        42,
    ]
    assert slots.tolist() == [1 * 4 + 2, 11 * 4 + 0, 4 * 4 + 3, 10 * 4 + 1, 10 * 4 + 2, 10 * 4 + 3]
    assert fast[10] == {"prompt": ([2], [items[2].request.all_token_ids[4]], 2)}  # row 2 predicts token 4


def test_build_host_inputs_is_the_same_on_either_path() -> None:
    """A decode step through build_host_inputs (the one-token path) against the same rows with a prompt
    chunk of one token spelled as a longer step's first row (the general path), array by array."""
    items, in_flight = _one_token_step()
    host, sampled = build_host_inputs(items, BLOCK_SIZE, BlockTableRows(8), None, in_flight.__getitem__)
    extra = _request("chunk", 12, 0)
    chunk = ScheduledRequest(extra, 0, 3, [13, 14, 15], False)
    mixed, mixed_sampled = build_host_inputs(
        [*items, chunk], BLOCK_SIZE, BlockTableRows(8), None, in_flight.__getitem__
    )
    assert sampled == mixed_sampled == [items[0], items[1], items[3], items[4], items[5]]
    n = len(items)
    assert host.query_lens == mixed.query_lens[:n] and host.seq_lens == mixed.seq_lens[:n]
    for index in (0, 1, 2, 4):  # ids, positions, slots, seq lens: the chunk's rows come last
        assert np.array_equal(host.arrays[index], mixed.arrays[index][: len(host.arrays[index])])
    assert np.array_equal(host.arrays[3], mixed.arrays[3][: n + 1])  # query start locations
    assert np.array_equal(host.arrays[5], mixed.arrays[5][:n, : host.arrays[5].shape[1]])  # block tables
    assert host.arrays[6].tolist() == mixed.arrays[6].tolist() == [1]  # the row in flight, its source
    assert host.arrays[7].tolist() == mixed.arrays[7].tolist() == [5]
    assert host.arrays[8].tolist() == [0, 1, 3, 4, 5]  # not every row samples: the sampled rows


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama-host-paths")
    save_tiny_model(folder, "LlamaForCausalLM")
    return folder


def test_kept_sampling_rows_equal_fresh_ones(tiny_llama: Path) -> None:
    """The model runner keeps each request's sampling row across steps: after a few steps (tokens in
    flight, outputs grown) every kept row reads as a row built from scratch, and a finished request's
    row is dropped."""
    llm = LLM(str(tiny_llama), dtype="float32", num_gpu_blocks_override=64, block_size=8)
    engine = llm.engine
    runner = engine.executor.runner
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, min_tokens=4)
    plain = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    engine.add_request("seeded", None, [5, 17, 33, 2, 90], seeded)
    engine.add_request("plain", None, list(range(40, 57)), plain)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        step = engine._in_flight
        if step is None:
            continue
        items = [item for item in step.scheduler_output.scheduled if item.samples]
        kept = runner._sampling_rows(step.scheduler_output.scheduled)
        for item, row in zip(items, kept, strict=True):
            fresh = runner._sampling_row(item)
            assert row is runner._rows[item.request.request_id]
            for field in dataclasses.fields(row):
                assert getattr(row, field.name) == getattr(fresh, field.name), field.name
            assert row.output_token_ids is item.request.output_token_ids
            checked += 1
    assert checked >= 8
    assert not engine.has_unfinished_requests()
    engine.step()  # the finished requests reach the runner
    assert "seeded" not in runner._rows and "plain" not in runner._rows
    assert engine.output_processor.parents == {}


def test_the_wire_tuples_carry_every_field() -> None:
    assert tuple(f.name for f in dataclasses.fields(RequestOutput)) == OUTPUT_FIELDS
    assert tuple(f.name for f in dataclasses.fields(CompletionOutput)) == CHOICE_FIELDS
    assert tuple(f.name for f in dataclasses.fields(RequestMetrics)) == METRICS_FIELDS


def test_outputs_with_every_field_set_cross_the_wire_whole() -> None:
    encoder, decoder = OutputEncoder(), OutputDecoder()
    metrics = RequestMetrics(1.0, 2.0, 3.0, 4.0, None, 16)
    texts = ["Hel", "Hello", "Hello wor", "Hi"]  # the last does not extend the one before: sent whole
    received = []
    for step, text in enumerate(texts, start=1):
        finished = step == len(texts)
        choice = CompletionOutput(
            0,
            text,
            list(range(step)),
            -0.5 * step,
            [{t: Logprob(-0.5, 1, "x")} for t in range(step)],
            "stop" if finished else None,
            "\n" if finished else None,
        )
        output = RequestOutput(
            "r",
            "the prompt",
            [1, 2, 3],
            [choice],
            finished,
            [None, {2: Logprob(-1.0, 1)}],
            dataclasses.replace(metrics, last_token_time=4.0 + step),
            5,
            {"note": step},
            "ran out" if finished else None,
        )
        want = pickle.loads(pickle.dumps(output))
        got = decoder.decode(pickle.loads(pickle.dumps(encoder.encode([output]))))
        assert got == [want]
        received.append(got[0])
    assert [r.outputs[0].text for r in received] == texts
    assert [len(r.outputs[0].token_ids) for r in received] == [1, 2, 3, 4]  # each output its own lists
    assert not encoder.forget("r")  # finished: both sides forgot it


def test_the_engine_process_heap_is_frozen_with_a_step_sized_threshold() -> None:
    """settle_engine_heap (run once the engine process's engine is built): the startup objects leave the
    collector's reach and the young generation holds a busy step's live objects; in a fresh process,
    so this test process's collector is left as it is."""
    import subprocess
    import sys

    code = (
        "import gc\n"
        "from fitserve.engine.engine_gc import ENGINE_GC_THRESHOLD, settle_engine_heap\n"
        "before = gc.get_threshold()\n"
        "settle_engine_heap()\n"
        "print(gc.get_freeze_count() > 10_000, gc.get_threshold() == (ENGINE_GC_THRESHOLD, *before[1:]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["True", "True"]
