"""`--reasoning-parser qwen3`: reasoning only inside a `<think>` block that was opened.

The output is reasoning up to `</think>` when it opens with `<think>` or when the rendered prompt
left a `<think>` open (thinking templates); otherwise (thinking disabled, the template closed an
empty block, or a model that does not reason) the whole output is content, streamed as it comes.
A `</think>` with no opening tag is then plain content text.
"""

from __future__ import annotations

from fitserve.server.parsers.reasoning import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    lone_end_tag_marks_reasoning = False
