"""`fitserve generate [MODEL] --prompt ...`: answer prompts once through `LLM`, print the answers."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from typing import Any

from fitserve.args import EngineArgs
from fitserve.engine.reasoning_split import prompt_ends_in_think, split_reasoning

logger = logging.getLogger("fitserve")

DEFAULT_CLI_MAX_TOKENS = 256
# Decoded prompt tail long enough to hold a chat template's trailing "<think>\n".
PROMPT_TAIL_TOKENS = 8


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


def run_generate(namespace: argparse.Namespace) -> int:
    if not namespace.prompt:
        raise ValueError("no prompt given: add --prompt 'your question' (repeat it for several prompts)")
    from fitserve.core.sampling_params import SamplingParams
    from fitserve.engine.llm import LLM

    requested = {
        "max_tokens": namespace.max_tokens,
        "temperature": namespace.temperature,
        "top_p": namespace.top_p,
        "top_k": namespace.top_k,
        "seed": namespace.seed,
    }
    overrides = {name: value for name, value in requested.items() if value is not None}
    SamplingParams(**overrides)  # refuses a bad sampling flag before the model loads
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
