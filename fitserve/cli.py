"""The `fitserve` command: `fitserve serve [MODEL] [flags]`, `fitserve generate [MODEL] --prompt ...`
and `fitserve bench ...` (fitserve/bench/cli_bench.py).

Flags and YAML keys are vLLM's (see fitserve/args.py). Each subcommand parses its own argv with its
own parser, so --config files and typo hints see exactly that subcommand's options.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from fitserve.arg_parser import FlexibleArgumentParser, parse_args_with_config
from fitserve.args import EngineArgs, add_engine_args
from fitserve.engine.reasoning_split import prompt_ends_in_think, split_reasoning
from fitserve.logger import setup_logging
from fitserve.planner.cli_plan import (
    add_doctor_parser,
    add_plan_parser,
    plan_from_namespace,
    run_doctor,
    run_plan,
    track_explicit_flags,
)
from fitserve.planner.fit import Choice

logger = logging.getLogger("fitserve")


DEFAULT_CLI_MAX_TOKENS = 256
# Decoded prompt tail long enough to hold a chat template's trailing "<think>\n".
PROMPT_TAIL_TOKENS = 8


def add_model_positional(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="The model, as `vllm serve MODEL`; wins over --model.",
    )


def add_server_args_if_built(parser: argparse.ArgumentParser) -> bool:
    """The server's own flags (host, port, api-key, ...), from fitserve/server/args.py once it exists."""
    try:
        from fitserve.server.args import add_server_args
    except ModuleNotFoundError as error:
        if error.name != "fitserve.server.args":
            raise
        return False
    add_server_args(parser)
    return True


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("generate")
    group.add_argument("--prompt", action="append", default=None, help="A prompt; repeat for several.")
    group.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Send each prompt as a user chat message when the tokenizer has a chat template; "
        "--no-chat sends the raw text as a completion.",
    )
    group.add_argument(
        "--max-tokens", type=int, default=DEFAULT_CLI_MAX_TOKENS, help="Most tokens to generate per prompt."
    )
    group.add_argument("--temperature", type=float, default=None, help="Default: generation_config.json's.")
    group.add_argument("--top-p", type=float, default=None, help="Default: generation_config.json's.")
    group.add_argument(
        "--top-k", type=int, default=None, help="0 or -1 = off. Default: generation_config.json's."
    )


def build_parser() -> tuple[FlexibleArgumentParser, dict[str, FlexibleArgumentParser]]:
    """The top-level parser (for --help) and one parser per subcommand."""
    top = FlexibleArgumentParser(prog="fitserve", description="Serve or run an LLM, fitted to this machine.")
    subparsers = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = subparsers.add_parser(
        "serve", help="Start the OpenAI-compatible server.", description="Start the OpenAI-compatible server."
    )
    add_model_positional(serve)
    add_engine_args(serve)
    add_server_args_if_built(serve)
    generate = subparsers.add_parser(
        "generate",
        help="Answer prompts once and print the answers.",
        description="Answer prompts and print them. --seed seeds the engine and each prompt's sampling.",
    )
    add_model_positional(generate)
    add_engine_args(generate)
    add_generate_args(generate)
    for parser in (serve, generate):
        track_explicit_flags(parser)  # auto-fit fills only what the user left unset
    from fitserve.bench.cli_bench import add_bench_parser

    add_bench_parser(subparsers)  # listed in --help; `fitserve bench ...` runs through bench_main
    plan = add_plan_parser(subparsers)
    doctor = add_doctor_parser(subparsers)
    return top, {"serve": serve, "generate": generate, "plan": plan, "doctor": doctor}


def apply_auto_fit(namespace: argparse.Namespace, serving: bool) -> None:
    """Plans before loading a byte: fills the engine settings the user left unset and logs each choice
    with its reason. A model that cannot fit stops here with the fix (a PlanError, a ValueError)."""
    result = plan_from_namespace(namespace, serving)
    for choice in result.choices:
        logger.info("%s = %s (%s)", choice.setting, choice.value, choice_origin(choice))
    for note in result.notes:
        logger.info("Plan note: %s", note)
    for choice in result.choices:
        if not choice.explicit and hasattr(namespace, choice.setting):
            setattr(namespace, choice.setting, getattr(result.engine_args, choice.setting))


def choice_origin(choice: Choice) -> str:
    """How a choice's log line names its origin: set by you (with why it matters, when the plan says),
    or auto-fit with why this value."""
    if not choice.explicit:
        return f"auto-fit: {choice.reason}"
    if choice.reason.startswith("set by you"):
        return choice.reason
    return f"set by you: {choice.reason}"


def run_serve(namespace: argparse.Namespace) -> int:
    apply_auto_fit(namespace, serving=True)
    try:
        from fitserve.server.api_server import run_server
    except ModuleNotFoundError as error:
        if error.name != "fitserve.server.api_server":
            raise
        raise ValueError(
            "the server is not part of this build (fitserve.server.api_server is missing)"
        ) from None
    run_server(namespace)
    return 0


def run_generate(namespace: argparse.Namespace) -> int:
    if not namespace.prompt:
        raise ValueError("no prompt given: add --prompt 'your question' (repeat it for several prompts)")
    from fitserve.engine.llm import LLM
    from fitserve.engine.sampling_params import SamplingParams

    requested = {
        "max_tokens": namespace.max_tokens,
        "temperature": namespace.temperature,
        "top_p": namespace.top_p,
        "top_k": namespace.top_k,
        "seed": namespace.seed,
    }
    overrides = {name: value for name, value in requested.items() if value is not None}
    SamplingParams(**overrides)  # refuses a bad sampling flag before the model loads
    apply_auto_fit(namespace, serving=False)
    llm = LLM.from_engine_args(EngineArgs.from_cli(namespace))
    params = dataclasses.replace(llm.get_default_sampling_params(), **overrides)
    tokenizer = llm.get_tokenizer()
    use_chat = namespace.chat and bool(getattr(tokenizer, "chat_template", None))
    if namespace.chat and not use_chat:
        logger.info("The tokenizer has no chat template: sending the prompts as raw text")
    if use_chat:
        conversations = [[{"role": "user", "content": prompt}] for prompt in namespace.prompt]
        outputs = llm.chat(conversations, sampling_params=params, use_tqdm=False)
    else:
        outputs = llm.generate(namespace.prompt, params, use_tqdm=False)
    return print_answers(namespace.prompt, outputs, tokenizer)


def print_answers(prompts: Sequence[str], outputs: Sequence[Any], tokenizer: Any) -> int:
    """Prints each answer; a request the engine ended with an error (e.g. out of GPU memory) prints its
    message to stderr instead. Returns the exit status: 1 when any request failed."""
    failed = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        if len(prompts) > 1:
            print(f"Prompt: {prompt}")
        if output.error is not None:
            failed += 1
            print(f"Error: {output.error}", file=sys.stderr)
            continue
        prompt_tail = tokenizer.decode(output.prompt_token_ids[-PROMPT_TAIL_TOKENS:])
        opened_think = prompt_ends_in_think(prompt_tail)
        for completion in output.outputs:
            print(format_answer(completion.text, opened_think))
    if failed:
        print(f"fitserve generate: {failed} of {len(prompts)} prompt(s) failed (see above)", file=sys.stderr)
    return 1 if failed else 0


def format_answer(text: str, prompt_opened_think: bool) -> str:
    """The text as printed: "Think: ..." and "Answer: ..." apart when the model reasoned."""
    split = split_reasoning(text, prompt_opened_think)
    if split.reasoning is None:
        return text.strip()
    return f"Think: {split.reasoning.strip()}\nAnswer: {split.answer.strip()}"


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "serve": run_serve,
    "generate": run_generate,
    "plan": run_plan,
    "doctor": run_doctor,
}


def parse_command(argv: Sequence[str]) -> tuple[str, FlexibleArgumentParser, argparse.Namespace]:
    """(command, its parser, its flags): --config applied, the MODEL positional folded into --model."""
    top, subcommands = build_parser()
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
    return command, parser, namespace


def server_only_keys(parser: argparse.ArgumentParser) -> frozenset[str]:
    """The option names (dests) of `fitserve serve`'s server flags that `parser` lacks: the keys of a serve
    config.yaml (host, port, api-key, ...) that a command running the engine alone skips."""
    server = FlexibleArgumentParser(add_help=False)
    add_server_args_if_built(server)
    known = {action.dest for action in parser._actions}
    return frozenset(action.dest for action in server.option_actions()) - known


def main(argv: Sequence[str] | None = None) -> int:
    """The `fitserve` console entry point; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["bench"]:
        from fitserve.bench.cli_bench import bench_main

        return bench_main(args[1:])
    setup_logging()
    command, parser, namespace = parse_command(args)
    try:
        return COMMANDS[command](namespace)
    except ValueError as error:  # bad input, refused with a message that says what to change
        logger.debug("refused", exc_info=True)
        parser.error(str(error))
