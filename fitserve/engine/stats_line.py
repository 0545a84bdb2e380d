"""The engine's periodic stats line (vLLM's): throughputs over the interval, queue sizes, cache usage."""

from __future__ import annotations

from typing import Any

from fitserve.spec_decode.stats import SpecDecodeStats


def stats_show_activity(previous: Any, current: Any) -> bool:
    """True when the interval processed tokens or requests are still running or waiting."""
    return bool(
        current.num_prompt_tokens_total != previous.num_prompt_tokens_total
        or current.num_generation_tokens_total != previous.num_generation_tokens_total
        or current.num_running
        or current.num_waiting
    )


def format_stats_line(previous: Any, current: Any, elapsed_s: float) -> str:
    """`Avg prompt throughput: X tokens/s, ... KV cache usage: P%, Prefix cache hit rate: Q%`.

    Throughputs are over the interval; the prefix cache hit rate is over all prompt tokens looked up
    since the start (hits / queries).
    """
    elapsed_s = max(elapsed_s, 1e-9)
    prompt_rate = (current.num_prompt_tokens_total - previous.num_prompt_tokens_total) / elapsed_s
    generation_rate = (current.num_generation_tokens_total - previous.num_generation_tokens_total) / elapsed_s
    queries = current.prefix_cache_queries
    hit_rate = 100.0 * current.prefix_cache_hits / queries if queries else 0.0
    return (
        f"Avg prompt throughput: {prompt_rate:.1f} tokens/s, "
        f"Avg generation throughput: {generation_rate:.1f} tokens/s, "
        f"Running: {current.num_running} reqs, Waiting: {current.num_waiting} reqs, "
        f"KV cache usage: {100.0 * current.kv_cache_usage:.1f}%, "
        f"Prefix cache hit rate: {hit_rate:.1f}%"
    )


def format_spec_decode_line(previous: Any, current: Any) -> str | None:
    """vLLM's "SpecDecoding metrics" line over the interval, or None when nothing was drafted in it."""
    if not current.spec_accepted_per_pos:
        return None
    return _spec_stats(current).log_line(since=_spec_stats(previous))


def _spec_stats(stats: Any) -> SpecDecodeStats:
    k = len(stats.spec_accepted_per_pos) or 1
    return SpecDecodeStats(
        k,
        stats.spec_num_drafts,
        stats.spec_num_draft_tokens,
        stats.spec_num_accepted_tokens,
        list(stats.spec_accepted_per_pos) or [0] * k,
    )
