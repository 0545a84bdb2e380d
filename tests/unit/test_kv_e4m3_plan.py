"""`--kv-cache-dtype fp8` (float8 e4m3) is planned on the GPUs below compute capability 8.9 (issues 35, 32: a
2080 Ti is 7.5), where the kernels convert the cache's bytes themselves (fitserve/kernels/fp8_bits.py); a GPU
older than fitserve's Triton kernels (below 7.0) is still refused, naming the fix."""

from __future__ import annotations

import json

import pytest

from fitserve.args import EngineArgs
from fitserve.cli.plan import run_plan
from fitserve.planner.fit import PlanError, auto_fit
from fitserve.planner.fit_errors import check_fp8_kv_cache_on_gpu
from fitserve.planner.hardware import parse_assume_gpus
from tests.unit.planner_helpers import fixture_path, model_info
from tests.unit.test_planner_cli import parse


@pytest.mark.parametrize("capability", [(7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (12, 0)])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_float8_caches_pass_from_volta_on(capability: tuple[int, int], kv_cache_dtype: str) -> None:
    check_fp8_kv_cache_on_gpu(kv_cache_dtype, capability)


@pytest.mark.parametrize(
    ("kv_cache_dtype", "kind"), [("fp8", "e4m3"), ("fp8_e4m3", "e4m3"), ("fp8_e5m2", "e5m2")]
)
def test_float8_caches_are_refused_below_the_kernels_oldest_gpu(kv_cache_dtype: str, kind: str) -> None:
    with pytest.raises(ValueError) as error:
        check_fp8_kv_cache_on_gpu(kv_cache_dtype, (6, 1))
    assert str(error.value) == (
        f"kv_cache_dtype={kv_cache_dtype} (float8 {kind}) is written and read by fitserve's Triton kernels, "
        "which need compute capability 7.0; this GPU has 6.1: run on a GPU of compute capability 7.0 or "
        "newer, or on the CPU (--device cpu)"
    )
    check_fp8_kv_cache_on_gpu("auto", (6, 1))  # no float8 cache: not this check's business


def test_the_2080_ti_plan_takes_e4m3_and_holds_twice_the_tokens() -> None:
    gpus = parse_assume_gpus("1x22@7.5")
    plans = {
        kv: auto_fit(model_info("llama-3.1-8b"), EngineArgs(kv_cache_dtype=kv, max_model_len=4096), gpus)
        for kv in ("auto", "fp8")
    }
    assert plans["fp8"].plan.inputs.dtype == "float16"  # what auto-fit picks below 8.0
    assert plans["fp8"].plan.inputs.kv_cache_dtype == "fp8"
    ratio = plans["fp8"].plan.kv_cache_tokens / plans["auto"].plan.kv_cache_tokens
    assert 1.9 < ratio <= 2.01, ratio
    with pytest.raises(PlanError) as error:
        auto_fit(model_info("llama-3.1-8b"), EngineArgs(kv_cache_dtype="fp8"), parse_assume_gpus("1x22@6.1"))
    assert error.value.kind == "kv_cache_dtype"
    assert "need compute capability 7.0; this GPU has 6.1" in str(error.value)


def test_fitserve_plan_for_two_2080_ti(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [fixture_path("qwen3-8b"), "-tp", "2", "--assume-gpus", "2x22@7.5", "--kv-cache-dtype", "fp8"]
    assert run_plan(parse("plan", [*argv, "--json"])) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["settings"]["kv_cache_dtype"] == "fp8"
    assert plan["kv_bytes_per_token"] == 36 * 1024  # 2 x 36 layers x 4 KV heads x 128 x 1 byte
    assert plan["kv_cache_tokens"] > 0
    assert {device["capability"] for device in plan["devices"]} == {"7.5"}
