"""`--reasoning-parser deepseek_r1`: DeepSeek-R1 style `<think>...</think>` output.

DeepSeek-R1 distill templates end the prompt with `<think>`, so the model's output starts inside the
reasoning and carries only the closing tag: all of it up to `</think>` is reasoning (all of it, when
generation stopped first). An output that opens with `<think>` is read the same way, and so is one
that closes a block it never opened (this parser's `lone_end_tag_marks_reasoning`, so after a prompt
that opened no `<think>` the text is held back until `</think>` or the end decides it). An output with
no tag at all after such a prompt (a model that does not reason) is all content.
"""

from __future__ import annotations

from fitserve.server.parsers.reasoning import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    lone_end_tag_marks_reasoning = True
