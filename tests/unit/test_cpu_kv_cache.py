"""The CPU KV cache's size (fitserve/cpu_kv_cache.py): 2 requests of max_model_len within half the RAM the
weights leave, never below one request plus a step; an explicit --cpu-kv-cache-space wins; the planner and
the engine get the same blocks from the same settings."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from fitserve.args import EngineArgs
from fitserve.config import EngineConfig
from fitserve.cpu_kv_cache import GiB, available_ram_bytes, cpu_kv_cache_size
from fitserve.planner.engine_plan import inputs_from_engine_config
from fitserve.planner.fit import auto_fit
from fitserve.planner.hardware import DeviceSpec
from fitserve.planner.memory import plan_memory
from fitserve.planner.model_info import inspect_model
from fitserve.planner.report import plan_json, plan_text
from fitserve.planner.resolve import create_engine_config, engine_config_from_fit
from fitserve.worker import platforms
from fitserve.worker.model_runner import ModelRunner
from tests.unit.model_helpers import build_hf_model, tiny_hf_config

# The default model (SmolLM2-135M) in float32: 2 (K, V) x 30 layers x 3 KV heads x 64 x 4 bytes = 45 KiB.
SMOLLM2_KV_BYTES_PER_TOKEN = 46_080


def smollm2(available: int | None, space: float | None = None, **settings: int):
    shape = {"max_model_len": 8192, "max_num_batched_tokens": 2048, "max_num_seqs": 256, "block_size": 16}
    shape.update(settings)
    return cpu_kv_cache_size(
        space, kv_bytes_per_token=SMOLLM2_KV_BYTES_PER_TOKEN, available_bytes=available, **shape
    )


def test_auto_size_is_two_full_length_requests_and_says_why() -> None:
    size = smollm2(int(19.3 * GiB))
    assert size.num_blocks == 2 * 8192 // 16 + 1 == 1025  # + the reserved null block
    assert size.bytes == 1025 * 16 * SMOLLM2_KV_BYTES_PER_TOKEN == 755_712_000
    assert size.tokens == 16_384 and not size.capped and not size.explicit
    assert size.log_line() == (
        "cpu_kv_cache_space = 0.70 GiB (auto-fit: 2 requests of max_model_len 8192 at 45 KiB a token, "
        "within 19.3 GiB available; --cpu-kv-cache-space GIB sets it)"
    )
    # the size follows max_model_len, not the RAM
    assert smollm2(int(100 * GiB), max_model_len=2048).num_blocks == 2 * 2048 // 16 + 1 == 257
    # unknown RAM: no cap
    assert smollm2(None).num_blocks == 1025
    assert "the RAM available is unknown" in smollm2(None).reason


def test_a_short_max_model_len_still_gets_one_request_plus_a_step() -> None:
    size = smollm2(int(8 * GiB), max_model_len=512, max_num_seqs=64)
    assert size.num_blocks == 512 // 16 + 2048 // 16 + 1 == 161  # more than 2 x 32 + 1
    assert size.reason.startswith("auto-fit: one request of max_model_len 512 plus a step's 2,048 tokens")


def test_the_pool_holds_a_block_for_each_of_max_num_seqs() -> None:
    """Every running request holds a block: a smaller pool would cap the batch below --max-num-seqs."""
    size = smollm2(int(8 * GiB), max_model_len=512)
    assert size.num_blocks == 256 + 1  # above one request plus a step (161) and 2 requests (65)
    assert size.reason.startswith("auto-fit: a 16-token block for each of max_num_seqs 256 at 45 KiB a token")
    assert smollm2(int(8 * GiB), max_model_len=512, max_num_seqs=512).num_blocks == 513


def test_little_ram_caps_the_auto_size_at_half_of_it() -> None:
    size = smollm2(GiB)  # half: 0.5 GiB = 728 blocks of 720 KiB
    assert size.num_blocks == size.cap_blocks == GiB // 2 // (16 * SMOLLM2_KV_BYTES_PER_TOKEN) == 728
    assert size.capped and size.bytes <= GiB // 2
    assert size.log_line() == (
        "cpu_kv_cache_space = 0.50 GiB (auto-fit: 50% of 1.0 GiB available holds 1.4 requests of "
        "max_model_len 8192 at 45 KiB a token, not 2; --cpu-kv-cache-space GIB sets it)"
    )
    # below the floor (one request of 8,192 + a step of 2,048 tokens) the floor wins and says so
    tiny = smollm2(int(0.3 * GiB))
    assert tiny.num_blocks == 512 + 128 + 1 and tiny.capped
    assert "the least it runs with, over 50% of 0.3 GiB available" in tiny.reason


def test_an_explicit_size_wins_over_the_rule() -> None:
    size = smollm2(GiB, space=4.0)  # more than half the RAM, more than 2 requests: still what was asked
    assert size.explicit and not size.capped
    assert size.num_blocks == int(4 * GiB // (16 * SMOLLM2_KV_BYTES_PER_TOKEN)) == 5825
    assert size.log_line() == (
        "cpu_kv_cache_space = 4.00 GiB (set by you: 93,184 tokens, 11.4x max_model_len 8192 at 45 KiB a "
        "token)"
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "cpu_kv_cache_space=0 GiB is not above 0: set --cpu-kv-cache-space to a size in GiB such as 1, "
         "or leave it unset to size it to max_model_len"),
        (-2.5, "cpu_kv_cache_space=-2.5 GiB is not above 0: set --cpu-kv-cache-space"),
        (math.nan, "cpu_kv_cache_space=nan GiB is not above 0: set --cpu-kv-cache-space"),
        (math.inf, "cpu_kv_cache_space=inf GiB is not a finite size: set --cpu-kv-cache-space"),
    ],
)  # fmt: skip
def test_a_bad_explicit_size_is_refused_naming_value_limit_and_fix(value: float, message: str) -> None:
    with pytest.raises(ValueError) as error:
        EngineArgs(cpu_kv_cache_space=value).check_ranges()
    assert str(error.value).startswith(message)
    EngineArgs().check_ranges()  # unset (auto) is fine


def test_an_explicit_size_above_the_ram_available_is_refused_by_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(platforms, "available_ram_bytes", lambda: 3 * GiB)
    config = SimpleNamespace(
        cache=SimpleNamespace(num_gpu_blocks_override=None, cpu_kv_cache_space_gib=8.0),
        parallel=SimpleNamespace(tensor_parallel_size=1),
    )
    with pytest.raises(ValueError) as error:
        platforms.CpuPlatform().size_kv_cache(SimpleNamespace(config=config))  # type: ignore[arg-type]
    assert str(error.value) == (
        "cpu_kv_cache_space=8 GiB is more than the 3.00 GiB of RAM available: set --cpu-kv-cache-space 1.5 "
        "or less, or leave it unset to size it to max_model_len"
    )


def test_available_ram_is_meminfo_memavailable(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        "MemTotal:       24576000 kB\nMemFree:         1000000 kB\nMemAvailable:   20237312 kB\n"
    )
    assert available_ram_bytes(str(meminfo)) == 20_237_312 * 1024
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree:         1000000 kB\n")  # an old kernel
    assert available_ram_bytes(str(meminfo)) == 1_000_000 * 1024
    assert available_ram_bytes(str(tmp_path / "missing")) is None


@pytest.fixture
def tiny_model(tmp_path: Path) -> Path:
    build_hf_model(tiny_hf_config("Qwen3ForCausalLM"), seed=0).save_pretrained(tmp_path)
    return tmp_path


def engine_blocks(
    config: EngineConfig, monkeypatch: pytest.MonkeyPatch, available: int, caplog: pytest.LogCaptureFixture
) -> tuple[int, str]:
    """The engine's CPU block count with `available` bytes of RAM left after loading, and its log line."""
    monkeypatch.setattr(platforms, "available_ram_bytes", lambda: available)
    runner = ModelRunner(config)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fitserve"):
        blocks = runner.size_kv_cache().num_kv_blocks
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cpu_kv_cache_space = ")]
    return blocks, line


def test_the_engine_gets_the_planners_blocks_for_the_same_args(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # auto-fit plans, the config holds its choices, the engine sizes the cache with the same rule
    args = EngineArgs(model=str(tiny_model), device="cpu")
    model = inspect_model(str(tiny_model))
    free = 16 * GiB
    cpu = DeviceSpec("cpu", 0, "CPU", 24 * GiB, free)
    fit = auto_fit(model, args, [cpu], host_ram_available=free)
    config = engine_config_from_fit(args, fit)
    assert config.cache.cpu_kv_cache_space_gib is None  # the engine applies the same rule itself
    # the engine reads the RAM once the weights are in: what the planner expects them to leave
    blocks, line = engine_blocks(config, monkeypatch, free - fit.plan.terms.weights, caplog)
    assert blocks == fit.plan.num_kv_blocks == max(2 * 512 // 16, 512 // 16 + 2048 // 16, 256) + 1
    assert line == fit.plan.cpu_kv.log_line()
    assert line in plan_text(fit).splitlines()  # `fitserve plan` shows it under its KV cache lines
    assert plan_json(fit)["cpu_kv_cache"] == {
        "gib": round(fit.plan.cpu_kv.gib, 3),
        "explicit": False,
        "reason": fit.plan.cpu_kv.reason,
    }
    assert line.startswith(
        "cpu_kv_cache_space = 0.02 GiB (auto-fit: a 16-token block for each of max_num_seqs 256"
    )
    # LLM(): the same resolution, the same blocks
    llm_config = create_engine_config(EngineArgs(model=str(tiny_model), device="cpu"))
    assert engine_blocks(llm_config, monkeypatch, free - fit.plan.terms.weights, caplog)[0] == blocks


def test_the_engine_and_the_planner_cap_alike(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    config = create_engine_config(EngineArgs(model=str(tiny_model), device="cpu", max_num_batched_tokens=256))
    block_bytes = 16 * 2 * 2 * 2 * 128 * 4  # 16 tokens x (K, V) x 2 layers x 2 KV heads x 128 x float32
    left = 2 * 56 * block_bytes  # half of it: 56 blocks, between one request + a step (49) and two (65)
    weights = plan_memory(
        inputs_from_engine_config(config, DeviceSpec("cpu", 0, "CPU", GiB, GiB))
    ).terms.weights
    # the planner reads the RAM before loading: the weights are still in it
    planned = plan_memory(inputs_from_engine_config(config, DeviceSpec("cpu", 0, "CPU", GiB, left + weights)))
    assert planned.cpu_kv is not None and planned.cpu_kv.capped
    blocks, line = engine_blocks(config, monkeypatch, left, caplog)
    assert blocks == planned.num_kv_blocks == 56
    assert "auto-fit: 50% of 0.0 GiB available holds 1.7 requests of max_model_len 512" in line
