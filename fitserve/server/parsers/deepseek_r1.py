"""`--reasoning-parser deepseek_r1`: the output starts inside the reasoning part.

DeepSeek-R1 style templates put `<think>` in the prompt, so the model's output carries only the
closing tag; an output that does open with `<think>` is read the same way. Everything up to
`</think>` is reasoning (all of it, when the output never closes the tag).
"""

from __future__ import annotations

from fitserve.server.parsers.reasoning import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def untagged_output_is_reasoning(self, prompt_text: str) -> bool:
        return True
