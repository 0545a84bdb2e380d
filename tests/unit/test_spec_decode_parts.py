"""Speculative decoding's parts on their own: the config as vLLM's keys read, prompt lookup, acceptance,
verify rows, the back-off, the counters and their log line."""

from __future__ import annotations

import numpy as np
import pytest

from fitserve.core.request import Request
from fitserve.core.sampling_params import SamplingParams
from fitserve.core.scheduler import ScheduledRequest
from fitserve.kv_groups import KvCacheGroup
from fitserve.spec_decode.config import SpeculativeConfig, check_speculative_model, parse_speculative_config
from fitserve.spec_decode.ngram import propose_ngram
from fitserve.spec_decode.speculator import MAX_VERIFY_TOKENS, WINDOW_STEPS, Speculator
from fitserve.spec_decode.stats import SpecDecodeStats
from fitserve.spec_decode.verify import num_accepted, verify_rows


def test_ngram_config_defaults_and_bounds_as_vllm():
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    config = parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    )
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (3, 3)
    assert parse_speculative_config(None) is None and parse_speculative_config({}) is None
    assert parse_speculative_config({"method": "[ngram]", "num_speculative_tokens": 1}).method == "ngram"


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"num_speculative_tokens": 3}, "has no method"),
        ({"method": "draft_model", "model": " ", "num_speculative_tokens": 3}, 'draft_model needs "model"'),
        ({"method": "ngram", "num_speculative_tokens": 16}, "16, above the limit of 15"),
        ({"method": "ngram", "num_speculative_tokens": True}, "whole number"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "above",
        ),
        ("ngram", "give a JSON object"),
    ],
)
def test_bad_configs_name_the_value_and_the_fix(raw, match):
    with pytest.raises(ValueError, match=match):
        parse_speculative_config(raw)


def test_drafters_with_a_kv_cache_need_a_full_attention_first_group():
    full = KvCacheGroup(None, (0, 2), 64, 16)
    window = KvCacheGroup(8, (1, 3), 64, 3)
    other_window = KvCacheGroup(32, (4,), 32, 6)
    for method in ("ngram", "draft_model", "eagle3", "mtp"):
        check_speculative_model(SpeculativeConfig(method, 3), ())  # layers alike: one full group
        check_speculative_model(SpeculativeConfig(method, 3), (full, window))  # Gemma-4 past its window
        check_speculative_model(SpeculativeConfig(method, 3), (window,))  # one group: nothing is freed
    # windows only, of two sizes: the first group frees blocks behind its window, a drafter's keys too
    check_speculative_model(SpeculativeConfig("ngram", 3), (window, other_window))
    for method in ("draft_model", "eagle3", "mtp"):
        with pytest.raises(
            ValueError, match=f"method {method} keeps the drafter's KV cache.*window of 8.*ngram"
        ):
            check_speculative_model(SpeculativeConfig(method, 3), (window, other_window))


def _reference_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest suffix (max_n down to min_n) found earlier, its latest occurrence: a plain loop."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


def test_prompt_lookup_matches_a_plain_loop():
    rng = np.random.default_rng(0)
    for _ in range(400):
        length = int(rng.integers(1, 40))
        tokens = rng.integers(0, 6, size=length).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 3))
        k = int(rng.integers(1, 5))
        got = propose_ngram(np.array(tokens, dtype=np.int64), min_n, max_n, k)
        assert got == _reference_ngram(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)


def test_prompt_lookup_prefers_the_longest_then_the_latest_match():
    tokens = np.array([1, 2, 3, 9, 9, 2, 3, 7, 7, 1, 2, 3], dtype=np.int64)
    assert propose_ngram(tokens, 1, 3, 2) == [9, 9]  # "1 2 3" matches at the start only
    assert propose_ngram(tokens, 1, 2, 2) == [7, 7]  # "2 3": the latest occurrence wins
    assert propose_ngram(np.array([4, 5, 6], dtype=np.int64), 1, 3, 2) == []


def test_acceptance_is_the_drafts_prefix_equal_to_the_samples():
    assert num_accepted([5, 6, 7, 8], [5, 6, 7]) == 3
    assert num_accepted([5, 0, 7, 8], [5, 6, 7]) == 1
    assert num_accepted([0, 6, 7, 8], [5, 6, 7]) == 0


def _request(tokens: list[int], outputs: list[int]) -> Request:
    request = Request("r", "r", 0, tokens, SamplingParams(max_tokens=100), frozenset())
    for token in outputs:
        request.append_output_token(token)
    request.num_computed_tokens = request.num_tokens - 1
    return request


def test_verify_rows_are_one_token_each_reading_the_same_table():
    request = _request([1, 2, 3], [4])
    item = ScheduledRequest(request, 3, 4, [7, 8], True, (), (9, 10, 11))
    rows = verify_rows([item])
    assert [(r.start, r.num_new_tokens, r.draft_token_ids) for r in rows] == [
        (3, 1, ()),
        (4, 1, (9,)),
        (5, 1, (9, 10)),
        (6, 1, (9, 10, 11)),
    ]
    assert all(r.block_ids is item.block_ids and r.samples for r in rows)


def test_speculation_backs_off_on_large_batches_and_low_acceptance():
    speculator = Speculator(SpeculativeConfig("ngram", 3, 1, 2))
    many = [_request([1, 2, 1, 2], [1]) for _ in range(MAX_VERIFY_TOKENS // 4 + 1)]
    assert not speculator.wants_drafts(many)
    few = many[:4]
    assert speculator.wants_drafts(few)
    assert speculator.propose(few) == 4 and few[0].spec_token_ids == [2, 1]
    for _ in range(WINDOW_STEPS):
        speculator.record_step([(3, 0)] * 4, 4)
    assert not speculator.wants_drafts(few)  # paused after a window that gained nothing
    limited = Speculator(SpeculativeConfig("ngram", 3, 1, 2, disable_by_batch_size=4))
    assert not limited.wants_drafts(few) and limited.wants_drafts(few[:3])


class _Grammar:
    """A grammar state that accepts `accepts` drafts in a row (or is complete)."""

    def __init__(self, accepts: int, terminated: bool = False) -> None:
        self.accepts, self.is_terminated = accepts, terminated

    def valid_prefix_len(self, token_ids: list[int]) -> int:
        return min(self.accepts, len(token_ids))


def test_drafts_skip_prompts_and_follow_the_grammar():
    """A request still computing its prompt gets no drafts; a constrained one only the drafts its grammar
    accepts in a row (none once the grammar is complete)."""
    speculator = Speculator(SpeculativeConfig("ngram", 3, 1, 2))
    prefilling = _request([1, 2, 1, 2, 1], [])
    prefilling.num_computed_tokens = 2
    cut, refused, complete = (_request([1, 2, 1, 2], [1]) for _ in range(3))
    cut.grammar, refused.grammar, complete.grammar = _Grammar(1), _Grammar(0), _Grammar(3, terminated=True)
    assert speculator.propose([prefilling, cut, refused, complete]) == 1
    assert prefilling.spec_token_ids == [] and refused.spec_token_ids == [] and complete.spec_token_ids == []
    assert cut.spec_token_ids == [2]  # the lookup proposes 2, 1, 2; the grammar takes the first


def test_counters_and_the_log_line():
    stats = SpecDecodeStats(3)
    stats.record(3, 2)
    stats.record(3, 0)
    stats.record(2, 2)
    stats.record(0, 0)  # nothing drafted: not a draft
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 4)
    assert stats.accepted_per_pos == [2, 2, 0]
    line = stats.log_line()
    assert (
        "Mean acceptance length: 2.33" in line and "Per-position acceptance rate: 0.667, 0.667, 0.000" in line
    )
    assert "Avg Draft acceptance rate: 50.0%" in line
    assert stats.log_line(since=stats.snapshot()) is None


def test_bench_serve_reads_the_counters_from_metrics():
    from fitserve.bench.spec_metrics import format_spec_decode, parse_spec_counters, spec_decode_summary
    from fitserve.engine.engine import EngineStats
    from fitserve.server.metrics import ServerMetrics

    def page(drafts, drafted, accepted, per_pos):
        stats = EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, 1, 16)
        stats.spec_num_drafts, stats.spec_num_draft_tokens = drafts, drafted
        stats.spec_num_accepted_tokens, stats.spec_accepted_per_pos = accepted, per_pos
        return ServerMetrics("m", lambda: stats).render()[0].decode()

    before = parse_spec_counters(page(10, 30, 12, (6, 4, 2)))
    after = parse_spec_counters(page(30, 90, 48, (18, 16, 14)))
    summary = spec_decode_summary(before, after)
    assert summary["spec_decode_num_drafts"] == 20 and summary["spec_decode_draft_tokens"] == 60
    assert summary["spec_decode_acceptance_rate"] == pytest.approx(60.0)
    assert summary["spec_decode_acceptance_length"] == pytest.approx(2.8)
    assert summary["spec_decode_per_position_acceptance_rates"] == pytest.approx([0.6, 0.6, 0.6])
    assert "Acceptance length:" in format_spec_decode(summary, 50)
    plain = ServerMetrics("m", lambda: EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, 1, 16)).render()[0].decode()
    assert parse_spec_counters(plain) is None and spec_decode_summary(None, after) == {}
