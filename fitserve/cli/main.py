"""The `fitserve` command: `fitserve serve [MODEL] [flags]`, `fitserve generate [MODEL] --prompt ...`,
`fitserve plan`, `fitserve doctor` and `fitserve bench ...` (fitserve/bench/cli_bench.py).

Flags and YAML keys are vLLM's (see fitserve/args.py). Each subcommand parses its own argv with its
own parser, so --config files and typo hints see exactly that subcommand's options. Every command that
runs the engine resolves its settings the way `LLM()` does: `EngineArgs.from_cli` (which records the
flags and --config keys the user set), then fitserve/planner/resolve.py.

The modules below are imported inside the functions, after `main` has paused the garbage collector for
`fitserve serve` (fitserve/server/startup_gc.py): torch alone is about a second of imports.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from fitserve.logger import setup_logging
from fitserve.server import startup_gc

if TYPE_CHECKING:
    from fitserve.arg_parser import FlexibleArgumentParser

logger = logging.getLogger("fitserve")


def build_parser(
    with_bench: bool = True,
) -> tuple[FlexibleArgumentParser, dict[str, FlexibleArgumentParser]]:
    """The top-level parser (for --help) and one parser per subcommand. `with_bench=False` leaves out
    `bench` (its parsers import the HTTP client: a fifth of a second), for a command that is not it."""
    from fitserve.arg_parser import FlexibleArgumentParser
    from fitserve.args import add_engine_args
    from fitserve.cli.common import add_model_positional
    from fitserve.cli.generate import add_generate_args
    from fitserve.cli.plan import add_doctor_parser, add_plan_parser
    from fitserve.server.args import add_server_args

    top = FlexibleArgumentParser(prog="fitserve", description="Serve or run an LLM, fitted to this machine.")
    subparsers = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = subparsers.add_parser(
        "serve", help="Start the OpenAI-compatible server.", description="Start the OpenAI-compatible server."
    )
    add_model_positional(serve)
    add_engine_args(serve)
    add_server_args(serve)
    generate = subparsers.add_parser(
        "generate",
        help="Answer prompts once and print the answers.",
        description="Answer prompts and print them. --seed seeds the engine and each prompt's sampling.",
    )
    add_model_positional(generate)
    add_engine_args(generate)
    add_generate_args(generate)
    if with_bench:
        from fitserve.bench.cli_bench import add_bench_parser

        add_bench_parser(subparsers)  # listed in --help; `fitserve bench ...` runs through bench_main
    plan = add_plan_parser(subparsers)
    doctor = add_doctor_parser(subparsers)
    return top, {"serve": serve, "generate": generate, "plan": plan, "doctor": doctor}


def run_serve(namespace: argparse.Namespace) -> int:
    from fitserve.args import EngineArgs
    from fitserve.server.api_server import run_server

    run_server(EngineArgs.from_cli(namespace), namespace)
    return 0


def run_generate(namespace: argparse.Namespace) -> int:
    from fitserve.cli.generate import run_generate as run

    return run(namespace)


def run_plan(namespace: argparse.Namespace) -> int:
    from fitserve.cli.plan import run_plan as run

    return run(namespace)


def run_doctor(namespace: argparse.Namespace) -> int:
    from fitserve.cli.plan import run_doctor as run

    return run(namespace)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "serve": run_serve,
    "generate": run_generate,
    "plan": run_plan,
    "doctor": run_doctor,
}


def parse_command(argv: Sequence[str]) -> tuple[str, FlexibleArgumentParser, argparse.Namespace]:
    """(command, its parser, its flags): --config applied, the MODEL positional folded into --model."""
    from fitserve.arg_parser import parse_args_with_config
    from fitserve.args_explicit import EXPLICIT_FLAGS_DEST
    from fitserve.server.args import server_only_keys

    top, subcommands = build_parser(with_bench=not argv or argv[0] not in COMMANDS)
    if not argv:
        top.print_help(sys.stderr)
        top.exit(2)
    if argv[0] not in subcommands:
        top.parse_args(argv)  # prints help, or the error naming the valid commands, and exits
        top.exit(2)
    command, parser = argv[0], subcommands[argv[0]]
    namespace = parse_args_with_config(parser, argv[1:], server_only_keys(parser))
    if namespace.model_tag is not None:
        namespace.model = namespace.model_tag
        given = getattr(namespace, EXPLICIT_FLAGS_DEST, frozenset())
        setattr(namespace, EXPLICIT_FLAGS_DEST, frozenset(given) | {"model"})
    return command, parser, namespace


def main(argv: Sequence[str] | None = None) -> int:
    """The `fitserve` console entry point; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["bench"]:
        from fitserve.bench.cli_bench import bench_main

        return bench_main(args[1:])
    if args[:1] == ["serve"]:
        startup_gc.pause()  # resumed once the server is up (api_server.freeze_startup_heap)
    try:
        setup_logging()
        command, parser, namespace = parse_command(args)
        try:
            return COMMANDS[command](namespace)
        except ValueError as error:  # bad input, refused with a message that says what to change
            logger.debug("refused", exc_info=True)
            parser.error(str(error))
    finally:
        startup_gc.resume()
