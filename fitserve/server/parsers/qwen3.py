"""`--reasoning-parser qwen3`: reasoning only when a `<think>` block is open.

The output is reasoning up to `</think>` when it opens with `<think>` or when the rendered prompt
left a `<think>` open (thinking templates); otherwise (thinking disabled, the template closed an
empty block) the whole output is content.
"""

from __future__ import annotations

from fitserve.server.parsers.reasoning import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def untagged_output_is_reasoning(self, prompt_text: str) -> bool:
        return self.prompt_leaves_tag_open(prompt_text)
