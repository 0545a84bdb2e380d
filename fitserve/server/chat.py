"""Chat templates: which template, how message content is shaped for it, and rendering a history.

The template is the tokenizer's unless `--chat-template` names a file or gives the Jinja text itself;
a request may send its own `chat_template`. Content is handed to the template in one of two shapes
(`--chat-template-content-format`): "string" joins a message's text parts with newlines; "openai"
keeps the list of `{"type": "text", "text": ...}` parts. "auto" picks "openai" when the template
loops over a message's content, "string" otherwise.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.nodes
from jinja2.exceptions import TemplateError

from fitserve.server.args import CONTENT_FORMAT_CHOICES
from fitserve.server.errors import APIError
from fitserve.server.protocol import ChatCompletionToolParam, ChatMessage

logger = logging.getLogger(__name__)

ContentFormat = Literal["string", "openai"]
# Arguments the renderer passes to the tokenizer's template call itself (or that change what it returns):
# chat_template_kwargs may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a path to a Jinja file, or the template text itself (it contains `{`)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if "{" not in value and "\n" not in value:
        if not path.is_file():
            raise ValueError(
                f"--chat-template {value!r} is not a file: give the path of a Jinja template file "
                "or the template text itself"
            )
        return path.read_text(encoding="utf-8")
    return value


def detect_content_format(template: str) -> ContentFormat:
    """'openai' when the template iterates over a message's `content`, else 'string'."""
    try:
        tree = jinja2.Environment().parse(template)
    except TemplateError:
        return "string"
    for loop in tree.find_all(jinja2.nodes.For):
        if _reads_content(loop.iter):
            return "openai"
    return "string"


def _reads_content(node: jinja2.nodes.Node) -> bool:
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        key = node.arg
        return isinstance(key, jinja2.nodes.Const) and key.value == "content"
    if isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) and node.node is not None:
        return _reads_content(node.node)
    return False


def message_text_parts(message: ChatMessage, position: int) -> list[str]:
    """The text parts of a message's content; non-text parts are refused (fitserve serves text models)."""
    content = message.content
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    texts: list[str] = []
    for part_index, part in enumerate(content):
        where = f"messages[{position}].content[{part_index}]"
        part_type = part.get("type")
        if part_type not in ("text", "input_text"):
            raise APIError(
                f"{where}.type={part_type!r} is not supported: fitserve serves text-only models; "
                'send {"type": "text", "text": "..."} parts or a plain string',
                param=f"{where}.type",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise APIError(f"{where}.text must be a string (got {text!r})", param=f"{where}.text")
        texts.append(text)
    return texts


def conversation_for_template(
    messages: list[ChatMessage], content_format: ContentFormat
) -> list[dict[str, Any]]:
    """Messages as the template expects them: content shaped, tool-call arguments decoded to objects."""
    conversation: list[dict[str, Any]] = []
    for position, message in enumerate(messages):
        entry = message.model_dump(exclude_none=True)
        texts = message_text_parts(message, position)
        if content_format == "string":
            entry["content"] = "\n".join(texts)
        else:
            entry["content"] = [{"type": "text", "text": text} for text in texts]
        if message.tool_calls:
            entry["tool_calls"] = [_tool_call_for_template(call.model_dump()) for call in message.tool_calls]
        conversation.append(entry)
    return conversation


def _tool_call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    # HF templates write `tool_call.arguments | tojson`: hand them an object, not the JSON text.
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):
            call["function"]["arguments"] = json.loads(arguments) if arguments.strip() else {}
    return call


class ChatRenderer:
    """Renders a chat history to the prompt text with the server's (or the request's) template."""

    def __init__(self, tokenizer: Any, chat_template: str | None, content_format: str = "auto") -> None:
        if content_format not in CONTENT_FORMAT_CHOICES:
            raise ValueError(
                f"--chat-template-content-format {content_format!r} is not one of {CONTENT_FORMAT_CHOICES}"
            )
        self.tokenizer = tokenizer
        self.template = chat_template or getattr(tokenizer, "chat_template", None)
        self.content_format_setting = content_format

    def content_format(self, template: str) -> ContentFormat:
        if self.content_format_setting == "auto":
            return detect_content_format(template)
        return "openai" if self.content_format_setting == "openai" else "string"

    def render(
        self,
        messages: list[ChatMessage],
        *,
        tools: list[ChatCompletionToolParam] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        request_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        template = request_template or self.template
        if not template:
            raise APIError(
                "the model has no chat template: start the server with --chat-template FILE_OR_STRING, "
                "send chat_template in the request, or use /v1/completions",
                param="messages",
            )
        if add_generation_prompt and continue_final_message:
            raise APIError(
                "add_generation_prompt and continue_final_message are both true: set add_generation_prompt "
                "to false to continue the final assistant message",
                param="continue_final_message",
            )
        if continue_final_message and messages[-1].role != "assistant":
            raise APIError(
                f"continue_final_message needs an assistant message last (the last is {messages[-1].role!r})",
                param="continue_final_message",
            )
        reserved = sorted(set(template_kwargs or {}) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise APIError(
                f"chat_template_kwargs sets {', '.join(reserved)}, which the server sets itself: leave "
                f"{'them' if len(reserved) > 1 else 'it'} out (add_generation_prompt and "
                "continue_final_message are request fields of their own)",
                param="chat_template_kwargs",
            )
        conversation = conversation_for_template(messages, self.content_format(template))
        tool_dicts = [tool.model_dump(exclude_none=True) for tool in tools] if tools else None
        try:
            rendered = self.tokenizer.apply_chat_template(
                conversation,
                tools=tool_dicts,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **(template_kwargs or {}),
            )
        except TemplateError as exc:
            raise APIError(f"the chat template refused the messages: {exc}", param="messages") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            logger.warning("the chat template could not render a request's messages: %r", exc)
            raise APIError(
                f"the chat template could not render the messages ({type(exc).__name__}): check the "
                "messages' shape (roles, content, tool calls) and chat_template_kwargs",
                param="messages",
            ) from exc
        if not isinstance(rendered, str):
            raise APIError(
                "the chat template did not render the messages to text: check chat_template_kwargs",
                param="chat_template_kwargs",
            )
        return rendered
