"""Split a reasoning model's whole output into its thinking and its answer (DeepSeek-R1 style tags).

Pure text in, text out. The rule, in order:
- the output opens with "<think>" (after whitespace): reasoning up to "</think>", the answer after it;
  with no "</think>", generation stopped while thinking: all of it is reasoning and the answer is "";
- "</think>" appears without an opening tag: the chat template opened <think> inside the prompt, so
  the reasoning is everything before it;
- no tags: all reasoning when the caller says the prompt left <think> open, else no reasoning (None).
Nothing but the whitespace before an opening tag is dropped: callers trim as they print.
The server's `--reasoning-parser deepseek_r1` (fitserve/server/parsers) splits by the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None: the text holds no reasoning section
    answer: str


def split_reasoning(text: str, prompt_opened_think: bool = False) -> ReasoningSplit:
    body = text.lstrip()
    if body.startswith(THINK_START):
        reasoning, _, answer = body[len(THINK_START) :].partition(THINK_END)
        return ReasoningSplit(reasoning, answer)
    reasoning, found_end, answer = text.partition(THINK_END)
    if found_end:
        return ReasoningSplit(reasoning, answer)
    if prompt_opened_think:
        return ReasoningSplit(text, "")
    return ReasoningSplit(None, text)


def prompt_ends_in_think(prompt_tail: str) -> bool:
    """True when the rendered prompt (or its last tokens, decoded) leaves a <think> section open."""
    return prompt_tail.rstrip().endswith(THINK_START)
