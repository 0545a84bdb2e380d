"""`--reasoning-parser gemma4`: Gemma-4's thinking channel, `<|channel>thought\n...<channel|>`.

Gemma-4 thinks when the system turn carries `<|think|>` (the chat template adds it for
`chat_template_kwargs: {"enable_thinking": true}`). The model's turn then opens with
`<|channel>thought`, a new line, the reasoning and `<channel|>`; the answer follows. With thinking
off, the template ends the prompt with an empty, closed channel (`<|channel>thought\n<channel|>`),
so the output is all answer. `<|channel>` and `<channel|>` are special tokens: the server decodes
special tokens into the text while this parser is on (vLLM's gemma4 parser does the same).

Read as the other reasoning parsers read their tags (reasoning.py), with the `thought` label dropped
from the start of the reasoning; an output with no channel is all content, and so is a `<channel|>`
that no `<|channel>` opened (in the output, or left open by the prompt). The end-of-turn token's text
(`<turn|>`, `<eos>`, `<|tool_response>`) is dropped from the end of the output.
"""

from __future__ import annotations

from fitserve.server.parsers.gemma4_format import END_OF_OUTPUT_MARKERS
from fitserve.server.parsers.reasoning import ReasoningParser


class Gemma4ReasoningParser(ReasoningParser):
    name = "gemma4"
    start_tag = "<|channel>"
    end_tag = "<channel|>"
    reasoning_label = "thought"
    end_of_output_markers = END_OF_OUTPUT_MARKERS
    keeps_special_tokens = True
    lone_end_tag_marks_reasoning = False
