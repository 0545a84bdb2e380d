"""`fitserve bench`: bad flags are refused with a message naming the value and the fix; an unreachable
server is one line on stderr and exit status 1, never a traceback."""

from __future__ import annotations

import socket

import pytest

from fitserve.bench.cli_bench import bench_main, redact_secrets


def run(argv: list[str]) -> int:
    try:
        return bench_main(argv)
    except SystemExit as stop:  # argparse's own refusals (unknown choice, bad type)
        return int(stop.code)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["serve", "--num-prompts", "0"],
            "num_prompts=0 is below the minimum 1: set --num-prompts to 1 or more",
        ),
        (["serve", "--request-rate", "-2"], "request_rate=-2.0 is not above 0: set --request-rate"),
        (["serve", "--request-rate", "0"], "request_rate=0.0 is not above 0"),
        (["serve", "--burstiness", "0"], "burstiness=0.0 is not above 0: set --burstiness to 1"),
        (["serve", "--max-concurrency", "0"], "max_concurrency=0 is below the minimum 1"),
        (["serve", "--random-input-len", "-5"], "random_input_len=-5 is below the minimum 1"),
        (["serve", "--random-range-ratio", "1.5"], "random_range_ratio=1.5 is outside [0, 1)"),
        (["serve", "--dataset-name", "nope"], "invalid choice: 'nope'"),
        (
            ["serve", "--dataset-name", "sharegpt"],
            "--dataset-name sharegpt reads a file: add --dataset-path FILE",
        ),
        (
            ["serve", "--dataset-name", "custom"],
            "--dataset-name custom reads a file: add --dataset-path FILE",
        ),
        (
            ["serve", "--dataset-path", "d.json"],
            "--dataset-path d.json is for the sharegpt and custom datasets",
        ),
        (["serve", "--percentile-metrics", "ttft,foo"], "--percentile-metrics 'ttft,foo' names foo"),
        (["serve", "--metric-percentiles", "99,abc"], "holds 'abc', not a number: write e.g. 50,90,99"),
        (["serve", "--metric-percentiles", "0"], "holds 0, outside (0, 100]"),
        (
            ["serve", "--base-url", "localhost:8000"],
            "has no http:// or https:// scheme: write e.g. http://localhost",
        ),
        (["serve", "--request-rate", "abc"], "argument --request-rate: invalid float value: 'abc'"),
        (
            ["throughput", "--workload", "nano", "--input-len", "5"],
            "--workload nano fixes its own lengths: drop",
        ),
        (["throughput"], "no workload given: add --workload nano"),
        (["throughput", "--input-len", "0", "--output-len", "4"], "input_len=0 is below the minimum 1"),
        (["latency", "--num-iters", "0"], "num_iters=0 is below the minimum 1: set --num-iters to 1 or more"),
        (["latency", "--num-iters-warmup", "-1"], "num_iters_warmup=-1 is below the minimum 0"),
        (["bogus"], "invalid choice: 'bogus'"),
    ],
)
def test_bad_flags_are_refused(argv: list[str], message: str, capsys):
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_server_is_one_line_and_exit_1(capsys):
    port = free_port()
    assert run(["serve", "--port", str(port), "--num-prompts", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(
        f"fitserve bench serve: error: cannot reach the server at http://127.0.0.1:{port} ("
    )
    assert "start it with `fitserve serve`" in err


def test_api_key_is_redacted_from_the_saved_command():
    argv = ["serve", "--api-key", "sk-secret", "--api-key=sk-other", "--port", "1"]
    assert redact_secrets(argv) == ["serve", "--api-key", "***", "--api-key=***", "--port", "1"]


def test_plot_without_matplotlib_is_refused_before_sending(monkeypatch, capsys):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *rest: None if name == "matplotlib" else real_find_spec(name, *rest),
    )
    assert run(["serve", "--plot", "--port", str(free_port())]) == 2
    assert (
        "--plot needs matplotlib, which is not installed: run `pip install matplotlib`"
        in capsys.readouterr().err
    )


def test_tokenizer_choice(tmp_path):
    from fitserve.bench.serve import resolve_tokenizer_path

    with_tokenizer = tmp_path / "model"
    with_tokenizer.mkdir()
    (with_tokenizer / "tokenizer.json").write_text("{}")
    explicit = tmp_path / "explicit"
    explicit.mkdir()
    (explicit / "tokenizer_config.json").write_text("{}")
    assert resolve_tokenizer_path(str(explicit), str(with_tokenizer), None) == str(explicit)
    # an explicit folder with no tokenizer files is refused, naming the fix, before any request is sent
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="has none of tokenizer.json.*pass --tokenizer PATH_OR_ID"):
        resolve_tokenizer_path(str(config_only), "served-name", None)
    assert resolve_tokenizer_path(None, str(with_tokenizer), None) == str(with_tokenizer)
    # a served name that is no folder: the server's root folder for it
    assert resolve_tokenizer_path(None, "served-name", str(with_tokenizer)) == str(with_tokenizer)
