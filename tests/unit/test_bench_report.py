"""The bench serve summary table and result JSON: vLLM's labels, key names and file name."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from fitserve.bench.metrics import RequestTiming, compute_metrics
from fitserve.bench.report import format_summary, metric_keys, result_file_path, save_result_json

TIMINGS = [
    RequestTiming(
        prompt_len=10, output_tokens=4, ttft=0.1, itl=(0.05, 0.05, 0.1), latency=0.3, start_time=0.0
    ),
    RequestTiming(prompt_len=20, output_tokens=2, ttft=0.2, itl=(0.1,), latency=0.3, start_time=0.2),
]


@pytest.fixture(scope="module")
def metrics():
    return compute_metrics(TIMINGS, failed=1, duration=2.0, percents=[50, 99.9])


def test_table_rows_in_vllm_layout(metrics):
    table = format_summary(metrics, ["ttft", "itl"], max_concurrency=32, request_rate=4.0).splitlines()
    rows = [line.rstrip() for line in table]
    assert rows[0] == "============ Serving Benchmark Result ============"
    assert "Successful requests:                     2" in rows
    assert "Failed requests:                         1" in rows
    assert "Maximum request concurrency:             32" in rows
    assert "Request rate configured (RPS):           4.00" in rows
    assert "Total generated tokens:                  6" in rows
    assert "Output token throughput (tok/s):         3.00" in rows
    assert "---------------Time to First Token----------------" in rows
    assert "Mean TTFT (ms):                          150.00" in rows
    assert "P99.9 TTFT (ms):                         199.90" in rows
    assert "P50 ITL (ms):                            75.00" in rows
    assert not any("TPOT" in row or "E2EL" in row for row in rows)  # not asked for
    assert rows[-1] == "=" * 50


def test_unlimited_run_leaves_out_rate_and_concurrency_rows(metrics):
    table = format_summary(metrics, ["e2el"], max_concurrency=None, request_rate=float("inf"))
    assert "Request rate configured" not in table and "Maximum request concurrency" not in table
    assert "Mean E2EL (ms):                          300.00" in table


def test_json_keys_cover_every_metric(metrics):
    keys = metric_keys(metrics)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert {
            f"mean_{metric}_ms",
            f"median_{metric}_ms",
            f"std_{metric}_ms",
            f"p50_{metric}_ms",
        } <= keys.keys()
        assert f"p99.9_{metric}_ms" in keys
    assert keys["p50_e2el_ms"] == pytest.approx(300)


def namespace(**overrides) -> argparse.Namespace:
    values = {"result_filename": None, "result_dir": None, "label": None, "backend": "openai",
              "request_rate": float("inf"), "max_concurrency": None}  # fmt: skip
    values.update(overrides)
    return argparse.Namespace(**values)


def test_default_file_name_follows_vllm(tmp_path):
    name = result_file_path(namespace(max_concurrency=32), "/models/llama-3.1-8b", "20250101-000000")
    assert str(name) == "openai-infqps-concurrency32-llama-3.1-8b-20250101-000000.json"
    labelled = result_file_path(namespace(label="fit", request_rate=4.0, result_dir=str(tmp_path)), "m", "d")
    assert labelled == tmp_path / "fit-4.0qps-m-d.json"
    chosen = result_file_path(namespace(result_filename="x.json", result_dir=str(tmp_path)), "m", "d")
    assert chosen == tmp_path / "x.json"


def test_per_request_lists_only_with_save_detailed(tmp_path):
    result = {"completed": 2, "ttfts": [0.1, 0.2], "errors": ["", ""], "mean_ttft_ms": 150.0}
    save_result_json(result, tmp_path / "short.json", detailed=False)
    save_result_json(result, tmp_path / "sub" / "long.json", detailed=True)
    assert json.loads((tmp_path / "short.json").read_text()) == {"completed": 2, "mean_ttft_ms": 150.0}
    assert json.loads((tmp_path / "sub" / "long.json").read_text()) == result


def test_plot_without_matplotlib_names_the_install_command(monkeypatch):
    from fitserve.bench.plot import import_pyplot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ModuleNotFoundError
    with pytest.raises(
        ValueError, match="--plot needs matplotlib, which is not installed: run `pip install matplotlib`"
    ):
        import_pyplot()
