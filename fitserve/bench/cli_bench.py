"""`fitserve bench serve | throughput | latency`: the parsers and the dispatch.

`add_bench_parser(subparsers)` adds `bench` and its three benchmarks to the `fitserve` parser (for
--help); `bench_main(argv)` runs `fitserve bench ARGV...` and returns the exit status:
0 done, 1 the server could not be reached (one line on stderr), 2 bad flags (one line on stderr).
throughput and latency take every engine flag and --config FILE.yaml, as `fitserve serve` does.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import Any

from fitserve.arg_parser import FlexibleArgumentParser, parse_args_with_config
from fitserve.bench.latency import add_latency_args, run_latency
from fitserve.bench.serve_args import add_serve_args
from fitserve.bench.throughput import add_throughput_args, run_throughput
from fitserve.server.args import server_only_keys

EXIT_OK = 0
EXIT_UNREACHABLE = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
SECRET_FLAGS = ("--api-key",)


def _run_serve(args: argparse.Namespace) -> Any:
    from fitserve.bench.serve import run_serve_benchmark

    return run_serve_benchmark(args)


BENCHMARKS: dict[
    str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], Any]]
] = {
    "serve": (
        "Measure an OpenAI-compatible server (fitserve, vLLM, SGLang, Ollama, ...): TTFT, TPOT, ITL, E2EL, "
        "throughput.",
        add_serve_args,
        _run_serve,
    ),
    "throughput": (
        "Offline generation throughput of the engine in this process (built-in nano / equal workloads).",
        add_throughput_args,
        run_throughput,
    ),
    "latency": (
        "Offline latency of one batch (default batch 1), percentiles over --num-iters.",
        add_latency_args,
        run_latency,
    ),
}


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds `bench` with serve / throughput / latency to a `fitserve` subparsers object; returns `bench`."""
    bench, _ = _add_bench_parsers(subparsers)
    return bench


def _add_bench_parsers(subparsers: Any) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    bench = subparsers.add_parser(
        "bench",
        help="Benchmark a server (serve) or the engine (throughput, latency).",
        description="Benchmark a server (serve) or the engine (throughput, latency), as `vllm bench`.",
    )
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    leaves = {}
    for name, (summary, add_args, run) in BENCHMARKS.items():
        leaf = kinds.add_parser(name, help=summary, description=summary)
        add_args(leaf)
        leaf.set_defaults(bench_run=run)
        leaves[name] = leaf
    return bench, leaves


def bench_main(argv: Sequence[str]) -> int:
    """Run `fitserve bench` with argv (the words after `bench`); returns the exit status."""
    argv = list(argv)
    top = FlexibleArgumentParser(prog="fitserve")
    bench, leaves = _add_bench_parsers(top.add_subparsers(dest="command", metavar="COMMAND"))
    if not argv or argv[0] not in leaves:
        bench.parse_args(argv)  # prints help, or the error naming the benchmarks, and exits
        return EXIT_BAD_INPUT
    leaf = leaves[argv[0]]
    if argv[0] == "serve":
        args = leaf.parse_args(argv[1:])
    else:
        from fitserve.logger import setup_logging

        setup_logging()
        args = parse_args_with_config(leaf, argv[1:], server_only_keys(leaf))  # type: ignore[arg-type]
    args.command_line = shlex.join(["fitserve", "bench", *redact_secrets(argv)])
    from fitserve.bench.serve import ServerUnreachable

    try:
        args.bench_run(args)
    except ServerUnreachable as error:
        print(f"{leaf.prog}: error: {error}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except ValueError as error:
        print(f"{leaf.prog}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"{leaf.prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK


def redact_secrets(argv: Sequence[str]) -> list[str]:
    """argv with the values of secret flags (--api-key) replaced by ***."""
    redacted, hide_next = [], False
    for token in argv:
        if hide_next:
            redacted.append("***")
            hide_next = False
        elif token in SECRET_FLAGS:
            redacted.append(token)
            hide_next = True
        elif token.split("=", 1)[0] in SECRET_FLAGS and "=" in token:
            redacted.append(token.split("=", 1)[0] + "=***")
        else:
            redacted.append(token)
    return redacted


def main() -> int:
    return bench_main(sys.argv[1:])
