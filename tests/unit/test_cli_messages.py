"""What `fitserve serve` / `generate` print when they stop: features not built yet, a vLLM serve
config.yaml given to `generate`, and the README quoting the same text."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from fitserve.bench.cli_bench import EXIT_BAD_INPUT, bench_main
from fitserve.cli.main import main, parse_command
from fitserve.planner import resolve
from tests.paths import REPO_DIR, SHARED_DIR
from tests.unit.planner_helpers import fixture_path

SEED_CONFIGS = [SHARED_DIR / "fixtures" / name for name in ("seed-config-7gb.yaml", "seed-config-32gb.yaml")]
SERVER_KEYS_LINE = "host, port, api-key, disable-log-requests"


def error_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The `fitserve ... : error: ...` line `fitserve argv` exits 2 with."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert len(errors) == 1, errors
    return errors[0]


@pytest.fixture
def no_model_inspection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails a test that reaches the planner's model inspection: the refusals come before it."""

    def inspect_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("planned a setting serve refuses")

    monkeypatch.setattr(resolve, "inspect_model", inspect_model)


# ---- features not built yet -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["serve", "--distributed-executor-backend", "external_launcher"],
            "fitserve serve: error: not supported yet: --distributed-executor-backend external_launcher "
            "(drop it or set --distributed-executor-backend mp (processes of this host) or ray (Ray actors, "
            "on several machines too))",
        ),
        (
            ["generate", "--prompt", "hi", "-pp", "4", "--enable-expert-parallel"],
            "fitserve generate: error: not supported yet: --pipeline-parallel-size 4 with "
            "--enable-expert-parallel (drop --enable-expert-parallel (experts then split across "
            "--tensor-parallel-size), or set --pipeline-parallel-size 1)",
        ),
        (
            ["serve", "--pipeline-parallel-size", "2", "--cpu-offload-gb", "4"],
            "fitserve serve: error: not supported yet: --pipeline-parallel-size 2 with --cpu-offload-gb 4.0 "
            "(drop --cpu-offload-gb: each stage's GPU holds only its layers; raise the stages, or set "
            "--pipeline-parallel-size 1)",
        ),
        (
            ["serve", "--quantization", "modelopt"],
            "fitserve serve: error: not supported yet: --quantization modelopt (drop --quantization; the "
            "closest that run are --quantization fp8 or bitsandbytes (quantized while loading), or an int4 "
            "GPTQ, AWQ, compressed-tensors or AutoRound checkpoint of the model)",
        ),
        (
            ["serve", "--enable-lora"],
            "fitserve serve: error: not supported yet: --enable-lora "
            "(merge the adapter into the weights, or drop --enable-lora)",
        ),
    ],
)
def test_features_not_built_stop_before_planning_with_a_fix_serve_takes(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], no_model_inspection: None
) -> None:
    error = error_of(argv, capsys)
    assert error == message
    assert "--assume-gpus" not in error  # a `fitserve plan` flag that serve and generate refuse


def test_readme_quotes_what_serve_prints(
    capsys: pytest.CaptureFixture[str], no_model_inspection: None
) -> None:
    readme = (REPO_DIR / "README.md").read_text(encoding="utf-8")
    quoted = re.search(r"`(fitserve serve: error: not supported yet: [^`]*)`", readme)
    assert quoted is not None, "README no longer quotes the not-supported message"
    flags = re.search(r"not supported yet: (--[\w-]+ \d+)", quoted.group(1))
    assert flags is not None
    assert error_of(["serve", *flags.group(1).split()], capsys) == quoted.group(1)


def test_plan_refuses_a_tensor_parallel_size_the_heads_do_not_take(
    capsys: pytest.CaptureFixture[str],
) -> None:
    error = error_of(["plan", fixture_path("qwen3-0.6b"), "-tp", "3", "--device", "cpu"], capsys)
    assert error == (
        "fitserve plan: error: tensor_parallel_size=3 does not divide the model's 16 attention heads: set "
        "--tensor-parallel-size 2 or 4 (the nearest that work)"
    )


def test_device_cuda_without_a_gpu_names_only_flags_the_command_takes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(resolve, "probe_gpus", lambda: ())
    serve_error = error_of(["serve", "--device", "cuda"], capsys)
    assert serve_error.startswith(
        "fitserve serve: error: device=cuda but torch sees no CUDA GPU: set --device cpu or --device auto"
    )
    assert "--assume-gpus" not in serve_error
    plan_error = error_of(["plan", fixture_path("qwen3-0.6b"), "--device", "cuda"], capsys)
    assert "plan for one with --assume-gpus COUNTxGiB (e.g. 1x24)" in plan_error


# ---- a vLLM serve config.yaml given to generate ---------------------------------------------------------


@pytest.mark.parametrize("config", SEED_CONFIGS, ids=lambda path: path.name)
def test_generate_skips_the_server_keys_of_a_serve_config_in_one_log_line(
    config: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fitserve")
    command, _, namespace = parse_command(["generate", "--config", str(config), "--prompt", "hi"])
    assert command == "generate"
    assert not hasattr(namespace, "host") and not hasattr(namespace, "api_key")
    assert namespace.max_num_seqs in (8, 256) and namespace.served_model_name == ["DeepSeek-R1"]
    ignoring = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Ignoring")]
    assert ignoring == [
        f"Ignoring server settings in {config} that fitserve generate does not use: {SERVER_KEYS_LINE}"
    ]


@pytest.mark.parametrize("config", SEED_CONFIGS, ids=lambda path: path.name)
def test_generate_with_a_serve_config_takes_its_quantization_key_then_stops_on_the_model(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """quantization: bitsandbytes runs (nf4 while loading): what stops the seed configs is their model, a
    path or hub id of the user's machine."""
    error = error_of(["generate", "--config", str(config), "--prompt", "hi"], capsys)
    assert "DeepSeek-R1-Distill-Llama-70B" in error and "not supported yet" not in error


def test_generate_with_a_serve_config_then_stops_on_the_missing_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = SEED_CONFIGS[1]  # its model is a local path of the user's machine
    error = error_of(
        ["generate", "--config", str(config), "--prompt", "hi", "--quantization", "None"], capsys
    )
    assert error.startswith(
        "fitserve generate: error: model path "
        "/root/autodl-tmp/llms/deepseek-ai/DeepSeek-R1-Distill-Llama-70B does not exist"
    )


def test_a_key_no_command_knows_still_fails_with_its_closest_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("host: 0.0.0.0\nmax-num-seq: 8\n", encoding="utf-8")
    assert error_of(["generate", "--config", str(config), "--prompt", "hi"], capsys) == (
        f"fitserve generate: error: unknown key 'max-num-seq' in --config {config}; "
        "did you mean 'max-num-seqs'?"
    )
    config.write_text("hots: 0.0.0.0\n", encoding="utf-8")
    assert error_of(["generate", "--config", str(config), "--prompt", "hi"], capsys) == (
        f"fitserve generate: error: unknown key 'hots' in --config {config}; did you mean 'host'?"
    )


def test_serve_keeps_the_server_keys(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fitserve")
    _, _, namespace = parse_command(["serve", "--config", str(SEED_CONFIGS[0])])
    assert (namespace.host, namespace.port, namespace.api_key) == ("0.0.0.0", 6333, "xxxxx")
    assert not [r for r in caplog.records if r.getMessage().startswith("Ignoring")]


def test_bench_latency_takes_a_serve_config_too(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.INFO, logger="fitserve")
    assert bench_main(["latency", "--config", str(SEED_CONFIGS[0])]) == EXIT_BAD_INPUT
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("Ignoring")] == [
        f"Ignoring server settings in {SEED_CONFIGS[0]} that fitserve bench latency does not use: "
        f"{SERVER_KEYS_LINE}"
    ]
    err = capsys.readouterr().err
    assert "DeepSeek-R1-Distill-Llama-70B" in err and "not supported yet" not in err
