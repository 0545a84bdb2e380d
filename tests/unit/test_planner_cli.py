"""`fitserve plan` and `fitserve doctor` as fitserve/cli/main.py runs them: a subcommand parser from
add_plan_parser / add_doctor_parser, parsed with --config support, then run_plan / run_doctor."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest

from fitserve.arg_parser import FlexibleArgumentParser, parse_args_with_config
from fitserve.args import EngineArgs
from fitserve.cli import doctor
from fitserve.cli import plan as cli_plan
from fitserve.cli.doctor import CPU_KERNEL_NAMES, CUDA_TORCH_INSTALL, Check, machine_checks
from fitserve.cli.plan import add_doctor_parser, add_plan_parser, run_doctor, run_plan
from fitserve.planner import resolve
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
    assert (
        "--quantization awq or gptq (an AWQ or GPTQ checkpoint of the model) with --cpu-offload-gb"
        in (output["error"]["message"])
    )


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
    assert EngineArgs.from_cli(namespace).explicit() == {
        "gpu_memory_utilization",
        "enforce_eager",
        "max_num_seqs",
        "block_size",
    }
    assert EngineArgs.from_cli(parse("plan", ["m"])).explicit() == frozenset()


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
    # 60 GiB is more than the 33.87 GiB of 4-bit decoder layers (nf4: half a byte a weight and a float16
    # absmax per 64): all of them are offloaded; the bf16 embeddings and LM head (3.91 GiB) and one layer's
    # staging buffer (0.42 GiB) stay on the GPU.
    assert plan["weights_gib_per_gpu"] == pytest.approx(4.337, abs=0.005)
    assert "more than the 33.87 GiB of weights in the model's 80 decoder layers" in plan["notes"][0]
    # fitserve runs both --quantization bitsandbytes and CPU offload: nothing is planned only
    assert not [note for note in plan["notes"] if note.startswith("planned only")]


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
    assert checks["GPU 2"].status == "PASS" and "dtype auto picks float16 here" in checks["GPU 2"].detail
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
        line.startswith("PASS compute paths: attention CpuAttentionBackend on the CPU") for line in lines
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


# ---- doctor on simulated machines ------------------------------------------------------------------------


@pytest.fixture
def bare_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No /dev/nvidia* node, no nvidia-smi on PATH, C kernels switched off; returns the fake /dev."""
    dev = tmp_path / "dev"
    dev.mkdir()
    (tmp_path / "bin").mkdir()
    monkeypatch.setattr(doctor, "DEV_DIR", dev)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setenv("FITSERVE_CPU_KERNELS", "0")
    return dev


def test_doctor_on_a_cpu_only_machine_passes_the_cpu_torch_build(bare_machine: Path) -> None:
    host = _host(cuda_runtime_version=None, driver_version=None, torch_version="2.13.0+cpu")
    checks = {check.title: check for check in machine_checks(host, [])}
    assert checks["torch"].line() == (
        "PASS torch: 2.13.0+cpu, a CPU build; this machine has no NVIDIA GPU: fitserve runs on the CPU"
    )
    assert "NVIDIA driver" not in checks  # nothing to drive
    assert checks["CPU kernels"].line() == (
        "WARN CPU kernels: turned off by FITSERVE_CPU_KERNELS=0: torch's operations run instead (slower) "
        "-> fix: unset FITSERVE_CPU_KERNELS to use them"
    )
    assert [title for title, check in checks.items() if check.status != "PASS"] == ["CPU kernels"]
    cuda_build = {c.title: c for c in machine_checks(_host(driver_version=None), [])}
    assert cuda_build["torch"].status == "PASS" and "a CUDA 12.8 build" in cuda_build["torch"].detail


def test_doctor_warns_on_a_cpu_torch_build_where_a_gpu_device_node_exists(bare_machine: Path) -> None:
    (bare_machine / "nvidia0").touch()
    host = _host(cuda_runtime_version=None, driver_version=None, torch_version="2.13.0+cpu")
    checks = {check.title: check for check in machine_checks(host, [])}
    torch_check = checks["torch"]
    assert torch_check.status == "WARN"
    assert f"has an NVIDIA GPU ({bare_machine / 'nvidia0'})" in torch_check.detail
    assert torch_check.fix == f"install a CUDA build: {CUDA_TORCH_INSTALL}"
    assert checks["NVIDIA driver"].status == "WARN"  # a GPU is there: its driver is checked
    # a CUDA build that sees no GPU on such a machine points at the driver and CUDA_VISIBLE_DEVICES
    cuda_build = {c.title: c for c in machine_checks(_host(), [])}["torch"]
    assert cuda_build.status == "WARN" and "sees no GPU although this machine has one" in cuda_build.detail
    assert "CUDA_VISIBLE_DEVICES" in cuda_build.fix


def test_nvidia_smi_alone_counts_as_a_gpu(bare_machine: Path, tmp_path: Path) -> None:
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.write_text("#!/bin/sh\n", encoding="utf-8")
    smi.chmod(0o755)
    assert doctor.nvidia_hardware(_host(driver_version=None)) == "nvidia-smi"
    smi.unlink()
    assert doctor.nvidia_hardware(_host(driver_version=None)) is None
    assert doctor.nvidia_hardware(_host()) == "NVIDIA driver 570.86.15"


def test_cpu_kernels_check_on_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FITSERVE_CPU_KERNELS", raising=False)
    check = doctor.cpu_kernels_check()
    if check.status == "PASS":
        assert check.detail.startswith(f"{CPU_KERNEL_NAMES} built for this CPU and loaded")
        assert check.detail.endswith("libfitserve_cpu.so)")
    else:
        assert check.status == "WARN" and check.detail.startswith("not used: ") and check.fix


def test_cpu_kernels_check_without_a_compiler(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from fitserve.layers.cpu.c_kernels import library

    monkeypatch.delenv("FITSERVE_CPU_KERNELS", raising=False)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(library.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(library, "_loaded", {})  # forget this process's build; restored afterwards
    monkeypatch.setattr(library, "_answer", None)
    caplog.set_level(logging.INFO, logger="fitserve")
    check = doctor.cpu_kernels_check()
    assert check.line() == (
        "WARN CPU kernels: not used: no C compiler found (set CC, or install gcc); torch's operations run "
        "instead (slower) -> fix: install a C compiler (e.g. apt install gcc), or point CC at one"
    )
    assert not [r for r in caplog.records if "CPU kernels" in r.getMessage()]  # said once, by the check


def test_doctor_fixes_never_repeat_a_value_the_user_set() -> None:
    t4 = DeviceSpec("cuda", 0, "Tesla T4", 15 * GiB, 15 * GiB, (7, 5))
    asked_bf16 = next(c for c in machine_checks(_host(), [t4], dtype="bfloat16") if c.title == "GPU 0")
    assert asked_bf16.title == "GPU 0" and asked_bf16.status == "WARN"
    assert "bfloat16" not in asked_bf16.fix and "--dtype float16" in asked_bf16.fix
    busy = DeviceSpec("cuda", 0, "NVIDIA H100", int(79.19 * GiB), int(30 * GiB), (9, 0))

    def gpu_check(utilization: float | None) -> Check:
        checks = machine_checks(_host(), [busy], gpu_memory_utilization=utilization)
        return next(check for check in checks if check.title == "GPU 0")

    assert gpu_check(0.3).status == "PASS"  # 0.3 of the GPU is free for fitserve
    too_high = gpu_check(0.95)
    assert (
        too_high.fix == "stop them (nvidia-smi lists them), or lower --gpu-memory-utilization to 0.37 or less"
    )
    assert "set --gpu-memory-utilization 0.37" in gpu_check(None).fix


def test_doctor_plan_fix_does_not_name_the_dtype_already_set(
    bare_machine: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # 2.75 GiB: float32 does not fit (the fix names --dtype bfloat16), nor does bfloat16 once its KV
    # cache, activations and runtime are added
    small = _host(cuda_runtime_version=None, driver_version=None, ram_available_bytes=int(2.75 * GiB))
    for module in (cli_plan, resolve):  # the doctor's machine checks, and the plan's devices
        monkeypatch.setattr(module, "probe_host", lambda: small)
        monkeypatch.setattr(module, "probe_gpus", lambda: ())
    model = fixture_path("qwen3-0.6b")
    assert run_doctor(parse("doctor", [model, "--device", "cpu"])) == 1
    plan_line = next(line for line in capsys.readouterr().out.splitlines() if " plan: " in line)
    assert (
        plan_line.startswith("FAIL plan: the model needs")
        and "--dtype bfloat16 (weights 1.11 GiB" in plan_line
    )
    assert run_doctor(parse("doctor", [model, "--device", "cpu", "--dtype", "bfloat16"])) == 1
    plan_line = next(line for line in capsys.readouterr().out.splitlines() if " plan: " in line)
    assert plan_line.startswith("FAIL plan: the model needs") and "--dtype" not in plan_line


def test_doctor_says_serve_would_refuse_a_feature_not_built(
    bare_machine: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = fixture_path("qwen3-0.6b")
    argv = [model, "--distributed-executor-backend", "external_launcher", "--device", "cpu"]
    assert run_doctor(parse("doctor", argv)) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == (
        "FAIL plan: not supported yet: --distributed-executor-backend external_launcher (drop it or set "
        "--distributed-executor-backend mp (processes of this host) or ray (Ray actors, on several machines "
        "too))"
    )


def test_host_memory_fixes_each_fit_when_applied() -> None:
    from fitserve.args import EngineArgs
    from fitserve.planner.fit import PlanError, auto_fit
    from tests.unit.planner_helpers import model_info

    cpu = DeviceSpec("cpu", 0, "CPU", 16 * GiB, 6 * GiB)
    model = model_info("qwen3-0.6b")
    with pytest.raises(PlanError) as error:
        auto_fit(model, EngineArgs(cpu_kv_cache_space=8), [cpu])
    message = str(error.value)
    assert "but 6.00 GiB is available: any one of: --cpu-kv-cache-space " in message
    fixes = message.split("any one of: ", 1)[1].split("; --")
    assert len(fixes) >= 2 and fixes[-1].startswith("dtype bfloat16 --cpu-kv-cache-space ")
    for fix in fixes:
        words = fix.lstrip("-").split(" (", 1)[0].split()
        settings = {name.lstrip("-").replace("-", "_"): value for name, value in zip(words[::2], words[1::2])}
        values = {k: v if k == "dtype" else float(v) if "." in v else int(v) for k, v in settings.items()}
        auto_fit(model, EngineArgs(**{"cpu_kv_cache_space": 8, **values}), [cpu])  # fits: no PlanError
    with pytest.raises(PlanError) as error:
        auto_fit(model_info("llama-3.1-8b"), EngineArgs(dtype="bfloat16", cpu_kv_cache_space=1), [cpu])
    assert str(error.value).endswith(
        "is available: no setting fits it, the weights alone take 14.96 GiB: use a smaller model, a 4-bit "
        "GGUF of it, or a machine with more RAM"
    )
    assert "--dtype" not in str(error.value)


def test_a_cpu_plan_over_the_ram_names_no_gpu_only_fix() -> None:
    from fitserve.args import EngineArgs
    from fitserve.planner.fit import PlanError, auto_fit
    from tests.unit.planner_helpers import model_info

    cpu = DeviceSpec("cpu", 0, "CPU", 16 * GiB, 6 * GiB)
    for args in (EngineArgs(), EngineArgs(cpu_kv_cache_space=1), EngineArgs(max_model_len=2048)):
        with pytest.raises(PlanError) as error:
            auto_fit(model_info("llama-3.1-8b"), args, [cpu])
        assert error.value.kind == "host_memory", args
        message = str(error.value)
        assert "but 6.00 GiB is available: no setting fits it, the weights alone take 29.92 GiB" in message
        for gpu_only in ("--kv-cache-dtype", "--quantization", "CUDA graphs", "per GPU"):
            assert gpu_only not in message
