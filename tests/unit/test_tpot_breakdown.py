"""benchmarks/gpu/tpot_breakdown.py: the TPOT split of a step trace, with and without device columns."""

from __future__ import annotations

import importlib.util

import pytest

from tests.paths import REPO_DIR


def load_module():
    spec = importlib.util.spec_from_file_location(
        "tpot_breakdown", REPO_DIR / "benchmarks" / "gpu" / "tpot_breakdown.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_breakdown():
    return load_module().breakdown


def trace(durations_ms: list[float], prompts: list[int], device: list[tuple[float, float]] | None = None):
    """Rows of a step trace: steps launched back to back with these durations, 2 decode rows each."""
    rows, now = [], 100.0
    for i, (ms, prompt) in enumerate(zip(durations_ms, prompts)):
        row = [f"{now:.6f}", "2", str(prompt), "2"]
        if device is not None:
            row += [f"{device[i][0]:.4f}", f"{device[i][1]:.4f}"]
        rows.append(row)
        now += ms / 1e3
    rows.append([f"{now:.6f}", "0", "0", "0"] + (["0", "0"] if device is not None else []))
    return rows


def result(start: float, ttft: float, latency: float, outputs: int) -> dict:
    return {
        "start_times": [start],
        "ttfts": [ttft],
        "latencies": [latency],
        "output_lens": [outputs],
        "mean_ttft_ms": ttft * 1e3,
        "p99_ttft_ms": ttft * 1e3,
        "mean_tpot_ms": (latency - ttft) / (outputs - 1) * 1e3,
    }


def test_splits_decode_and_prompt_steps_and_nets_a_late_launch_against_an_early_one():
    breakdown = load_breakdown()
    # first token at 100.010 s; then 4 decode steps of 10 ms, one late (14) and one early (6), and a
    # 30 ms step with prompt tokens: 5 more tokens by 100.080 s
    durations = [10, 10, 14, 6, 30, 10, 10]
    steps = trace(durations, [1000, 0, 0, 0, 500, 0, 0])
    figures = breakdown(steps, result(100.0, 0.010, 0.080, 6), wave=1)
    assert figures["pure_decode_step_ms_at_batch_2"] == pytest.approx(10.0, abs=1e-3)
    # decode steps 10+14+6 then 10 (the last is cut at the request's last token, 100.080 s): 40 ms / 5
    assert figures["tpot_part_decode_steps_ms"] == pytest.approx(8.0, abs=1e-3)
    assert figures["tpot_part_steps_with_prompt_tokens_ms"] == pytest.approx(6.0, abs=1e-3)
    assert figures["slow_decode_steps"] == 1
    # 14 - 10 and 6 - 10 cancel; the cut last step (10 - 10) adds nothing
    assert figures["tpot_part_above_the_median_decode_step_ms"] == pytest.approx(0.0, abs=1e-3)
    assert "device" not in figures


def test_device_columns_tell_a_device_pause_from_host_jitter():
    breakdown = load_breakdown()
    durations = [10, 10, 14, 6, 10, 10, 10]
    device = [(10, 0), (10, 0), (10, 0), (30, 0), (10, 2), (10, 0), (10, 0)]
    steps = trace(durations, [1000, 0, 0, 0, 0, 0, 0], device)
    figures = breakdown(steps, result(100.0, 0.010, 0.070, 7), wave=1)
    assert figures["device"]["median_decode_step_ms_at_batch_2"] == pytest.approx(10.0)
    assert figures["device"]["slow_decode_steps"] == 1
    # one device step 20 ms over the median, over 6 tokens; 2 ms of idle device over 6 tokens
    assert figures["device"]["tpot_part_above_the_median_decode_step_ms"] == pytest.approx(20 / 6, abs=1e-3)
    assert figures["device"]["tpot_part_idle_ms"] == pytest.approx(2 / 6, abs=1e-3)


def test_timeline_counts_requests_steps_and_prompt_tokens_per_interval():
    timeline = load_module().timeline
    # steps of 10 ms from 100.000 s (a 600-token prompt step, three decode steps, a 300-token step, one
    # more, and the helper's closing row at 100.060 s); requests from 99.999 s, in intervals of 25 ms
    steps = trace([10] * 6, [600, 0, 0, 0, 300, 0], device=[(9.0, 0.1)] * 6)
    two = dict(result(99.999, 0.010, 0.036, 4))
    two["start_times"] = [99.999, 100.032]
    two["latencies"] = [0.036, 0.020]
    rows = timeline(steps, two, 0.025)
    assert [row["started"] for row in rows] == [1, 1, 0]
    assert [row["finished"] for row in rows] == [0, 1, 1]
    assert [row["steps"] for row in rows] == [3, 2, 2]
    assert [row["decode_only_steps"] for row in rows] == [2, 1, 2]
    assert [row["prompt_tokens"] for row in rows] == [600, 300, 0]
    assert [row["mean_decode_rows"] for row in rows] == [2.0, 2.0, 1.0]
    assert [row["device_ms"] for row in rows] == [27.0, 18.0, 9.0]
    # a server without a trace: the client's side alone
    client_only = timeline([], two, 0.025)
    assert [row["finished"] for row in client_only] == [0, 1, 1] and "prompt_tokens" not in client_only[0]
