"""`fitserve plan` and `fitserve doctor` as fitserve/cli.py runs them: a subcommand parser from
add_plan_parser / add_doctor_parser, parsed with --config support, then run_plan / run_doctor."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from fitserve.arg_parser import FlexibleArgumentParser, parse_args_with_config
from fitserve.planner.cli_plan import (
    add_doctor_parser,
    add_plan_parser,
    explicit_engine_fields,
    run_doctor,
    run_plan,
)
from fitserve.planner.doctor import Check, machine_checks
from fitserve.planner.hardware import DeviceSpec, GiB, HostInfo
from tests.unit.planner_helpers import H100, fixture_path

JSON_KEYS = {
    "weights_gib_per_gpu",
    "activation_gib",
    "cuda_graph_gib",
    "runtime_overhead_gib",
    "kv_bytes_per_token",
    "kv_cache_gib_per_gpu",
    "num_kv_blocks",
    "kv_cache_tokens",
    "max_concurrency",
    "budget_gib_per_gpu",
    "settings",
    "choices",
    "notes",
    "model",
    "devices",
}


def parse(command: str, argv: list[str]) -> argparse.Namespace:
    top = FlexibleArgumentParser(prog="fitserve")
    subparsers = top.add_subparsers(dest="command")
    parser = add_plan_parser(subparsers) if command == "plan" else add_doctor_parser(subparsers)
    namespace = parse_args_with_config(parser, argv)
    if namespace.model_tag is not None:
        namespace.model = namespace.model_tag
    return namespace


def plan_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    status = run_plan(parse("plan", [*argv, "--json"]))
    return status, json.loads(capsys.readouterr().out)


def test_json_plan_of_the_8b_on_an_h100(capsys: pytest.CaptureFixture[str]) -> None:
    status, plan = plan_json(
        [fixture_path("llama-3.1-8b"), "--max-model-len", "4096", "--assume-gpus", H100], capsys
    )
    assert status == 0
    assert set(plan) >= JSON_KEYS
    assert plan["kv_cache_tokens"] == pytest.approx(444_528, rel=0.03)
    assert plan["weights_gib_per_gpu"] == pytest.approx(14.958, abs=0.001)
    assert plan["kv_bytes_per_token"] == 131072
    assert plan["settings"]["max_model_len"] == 4096
    assert plan["settings"]["dtype"] == "bfloat16"
    assert plan["settings"]["cudagraph_capture_sizes"][:4] == [1, 2, 4, 8]
    assert plan["devices"] == [
        {
            "kind": "cuda",
            "name": "assumed GPU",
            "total_gib": 79.19,
            "free_gib": 79.19,
            "capability": "9.0",
            "assumed": True,
        }
    ]
    assert plan["model"]["parameters"] == 8_030_261_248
    by_setting = {c["setting"]: c for c in plan["choices"]}
    assert by_setting["max_model_len"]["explicit"] is True
    assert by_setting["dtype"] == {
        "setting": "dtype",
        "value": "bfloat16",
        "reason": "the model's bfloat16; SM 9.0 runs it natively",
        "explicit": False,
    }


def test_text_plan_shows_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_plan(parse("plan", [fixture_path("qwen3-8b"), "-tp", "2", "--assume-gpus", "2x20@8.9"])) == 0
    text = capsys.readouterr().out
    assert "devices  2 x assumed GPU (20.00 GiB, SM 8.9)" in text
    assert "weights (8.19 B params, bfloat16, 1/2 per GPU)" in text
    assert "72 KiB per token = 2 (K, V) x 36 layers x 4 KV heads x 128 x 2 bytes" in text
    assert "Maximum concurrency for 40,960 tokens per request:" in text


def test_plan_that_does_not_fit_raises_or_prints_json_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [fixture_path("llama-3.3-70b"), "--assume-gpus", "1x12@8.6"]
    with pytest.raises(
        ValueError, match=r"the weights do not fit on GPU 0 \(assumed GPU, 12.00 GiB, SM 8.6\)"
    ):
        run_plan(parse("plan", argv))
    status, output = plan_json(argv, capsys)
    assert status == 1
    assert output["error"]["kind"] == "weights"
    assert "--quantization awq or gptq with --cpu-offload-gb" in output["error"]["message"]


def test_bad_assume_gpus_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=r"--assume-gpus '2x': memory '' is not a number of GiB"):
        run_plan(parse("plan", [fixture_path("qwen3-0.6b"), "--assume-gpus", "2x"]))
    with pytest.raises(
        ValueError, match=r"--assume-gpus plans for GPUs but --device is cpu: drop one of them"
    ):
        run_plan(parse("plan", [fixture_path("qwen3-0.6b"), "--assume-gpus", "1x8", "--device", "cpu"]))


def test_explicit_flags_and_yaml_keys_are_recorded(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("max-num-seqs: 256\nblock_size: 32\n")
    namespace = parse(
        "plan", ["m", "--gpu-memory-utilization", "0.9", "--enforce-eager", "--config", str(config), "--json"]
    )
    assert explicit_engine_fields(namespace) == {
        "gpu_memory_utilization",
        "enforce_eager",
        "max_num_seqs",
        "block_size",
    }
    assert explicit_engine_fields(parse("plan", ["m"])) == frozenset()


def test_explicit_default_utilization_is_not_lowered(capsys: pytest.CaptureFixture[str]) -> None:
    """0.9 typed by the user stays 0.9 (and is refused when it does not fit); unset it would be lowered."""
    argv = [fixture_path("qwen3-0.6b"), "--assume-gpus", "1x24", "--gpu-memory-utilization", "0.9"]
    status, plan = plan_json(argv, capsys)
    assert status == 0
    by_setting = {c["setting"]: c for c in plan["choices"]}
    assert by_setting["gpu_memory_utilization"]["explicit"] is True


def test_user_yaml_with_server_keys_plans(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The 7 GB guide's config.yaml (server keys and all) plans the 70B on a 32 GB GPU at utilization 0.25."""
    config = tmp_path / "seed-config-7gb.yaml"
    config.write_text(
        'model: "/nonexistent/DeepSeek-R1-Distill-Llama-70B"\nhost: "0.0.0.0"\nport: 6333\napi-key: "x"\n'
        'dtype: "bfloat16"\nquantization: "bitsandbytes"\ngpu-memory-utilization: 0.25\ncpu-offload-gb: 60\n'
        "swap-space: 20\nmax-num-seqs: 8\ntensor-parallel-size: 1\nmax-num-batched-tokens: 512\n"
        "max-model-len: 512\nblock-size: 16\nmax-seq-len-to-capture: 512\nenforce-eager: true\n"
        "trust-remote-code: true\n"
    )
    argv = [fixture_path("llama-3.3-70b"), "--config", str(config), "--assume-gpus", "1x31.75@8.6"]
    status, plan = plan_json(argv, capsys)
    assert status == 0
    settings = plan["settings"]
    assert (settings["quantization"], settings["max_num_seqs"], settings["enforce_eager"]) == (
        "bitsandbytes",
        8,
        True,
    )
    # 60 GiB is more than the 35.86 GiB of 4-bit decoder layers: all of them are offloaded; the bf16
    # embeddings and LM head (3.91 GiB) and one layer's staging buffer (0.45 GiB) stay on the GPU.
    assert plan["weights_gib_per_gpu"] == pytest.approx(4.36, abs=0.005)
    assert "more than the 35.86 GiB of weights in the model's 80 decoder layers" in plan["notes"][0]
    assert (
        "planned only: --quantization bitsandbytes (fitserve does not run quantized weights yet; vLLM does)"
        in plan["notes"]
    )
    planned_only = [note for note in plan["notes"] if note.startswith("planned only")]
    assert len(planned_only) == 1  # CPU offload runs in fitserve: only the quantization is noted


def _host(**changes: object) -> HostInfo:
    values: dict[str, object] = {
        "cpu_count": 16,
        "ram_total_bytes": 128 * GiB,
        "ram_available_bytes": 100 * GiB,
        "shm_total_bytes": 64 * GiB,
        "shm_free_bytes": 64 * GiB,
        "cache_dir": "/cache",
        "cache_disk_free_bytes": 500 * GiB,
        "python_version": "3.11.9",
        "torch_version": "2.13.0",
        "cuda_runtime_version": "12.8",
        "driver_version": "570.86.15",
    }
    values.update(changes)
    return HostInfo(**values)  # type: ignore[arg-type]


def test_doctor_checks_name_their_fix() -> None:
    gpus = [
        DeviceSpec("cuda", 0, "NVIDIA H100", int(79.19 * GiB), int(30 * GiB), (9, 0)),
        DeviceSpec("cuda", 1, "Tesla P100", 16 * GiB, 16 * GiB, (6, 0)),
        DeviceSpec("cuda", 2, "Tesla T4", 15 * GiB, 15 * GiB, (7, 5)),
    ]
    checks = {check.title: check for check in machine_checks(_host(shm_total_bytes=64 * 1024**2), gpus)}
    assert checks["python"].status == "PASS"
    assert checks["NVIDIA driver"].line() == "PASS NVIDIA driver: 570.86.15"
    busy = checks["GPU 0"]
    assert busy.status == "WARN" and "other processes hold 49.19 GiB" in busy.detail
    assert "set --gpu-memory-utilization 0.37 or lower" in busy.line()
    assert checks["GPU 1"].status == "FAIL" and "compute capability 7.0 or newer" in checks["GPU 1"].line()
    assert checks["GPU 2"].status == "WARN" and "dtype auto picks float16" in checks["GPU 2"].fix
    assert checks["/dev/shm"].line().endswith("-> fix: run docker with --ipc=host or --shm-size=16g")
    for check in checks.values():
        assert check.status in ("PASS", "WARN", "FAIL")
        assert check.status == "PASS" or check.fix, check


def test_doctor_without_gpu_on_this_machine(capsys: pytest.CaptureFixture[str]) -> None:
    status = run_doctor(parse("doctor", [fixture_path("qwen3-0.6b"), "--device", "cpu"]))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("PASS python")
    assert any(line.startswith(("PASS host RAM", "WARN host RAM")) for line in lines)
    assert any(
        line.startswith("PASS compute paths: attention TorchReferenceBackend on the CPU") for line in lines
    )
    plan_line = next(line for line in lines if " plan: " in line)
    assert plan_line.startswith(("PASS plan:", "FAIL plan:"))
    assert status in (0, 1)


def test_check_line_format() -> None:
    assert (
        Check("WARN", "disk", "2.0 GiB free", "free space").line()
        == "WARN disk: 2.0 GiB free -> fix: free space"
    )
    assert Check("PASS", "disk", "200 GiB free", "unused").line() == "PASS disk: 200 GiB free"
