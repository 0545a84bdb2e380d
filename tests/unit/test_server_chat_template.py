"""Chat template handling with the real SmolLM2 tokenizer and its template."""

from __future__ import annotations

from pathlib import Path

import pytest

from fitserve.server.chat import ChatRenderer, detect_content_format, load_chat_template
from fitserve.server.errors import APIError
from fitserve.server.protocol import ChatCompletionToolParam, ChatMessage
from tests.unit.server_helpers import smollm2_tokenizer

SYSTEM_DEFAULT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)
PARTS_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}]{% for part in m['content'] %}<{{ part.text }}>{% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)


def messages(*entries: dict) -> list[ChatMessage]:
    return [ChatMessage.model_validate(entry) for entry in entries]


def test_tokenizer_template_with_system_and_turns() -> None:
    renderer = ChatRenderer(smollm2_tokenizer(), None)
    prompt = renderer.render(
        messages(
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
        )
    )
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )


def test_text_parts_are_joined_for_a_string_template() -> None:
    renderer = ChatRenderer(smollm2_tokenizer(), None)
    prompt = renderer.render(
        messages(
            {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}
        ),
        add_generation_prompt=False,
    )
    assert prompt == SYSTEM_DEFAULT + "<|im_start|>user\none\ntwo<|im_end|>\n"


def test_openai_content_format_keeps_parts() -> None:
    assert detect_content_format(PARTS_TEMPLATE) == "openai"
    assert detect_content_format(smollm2_tokenizer().chat_template) == "string"
    renderer = ChatRenderer(smollm2_tokenizer(), PARTS_TEMPLATE)
    prompt = renderer.render(messages({"role": "user", "content": "solo"}))
    assert prompt == "[user]<solo>[assistant]"
    forced = ChatRenderer(smollm2_tokenizer(), None, content_format="openai")
    assert forced.content_format(smollm2_tokenizer().chat_template) == "openai"


def test_non_text_part_is_refused_with_its_position() -> None:
    renderer = ChatRenderer(smollm2_tokenizer(), None)
    history = messages(
        {"role": "user", "content": "look"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]},
    )
    with pytest.raises(APIError) as caught:
        renderer.render(history)
    assert caught.value.status == 400
    assert caught.value.param == "messages[1].content[0].type"
    assert "'image_url' is not supported" in caught.value.message


def test_tool_history_reaches_the_template() -> None:
    template = (
        "{% for m in messages %}{{ m.role }}:"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}"
        "{{ c.function.name }}({{ c.function.arguments.city }})"
        "{% endfor %}{% endif %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}{{ m.content }}|"
        "{% endfor %}{% if tools %}tools={{ tools | map(attribute='function.name') | join(',') }}{% endif %}"
    )
    renderer = ChatRenderer(smollm2_tokenizer(), template)
    history = messages(
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    )
    tools = [
        ChatCompletionToolParam.model_validate({"type": "function", "function": {"name": "get_weather"}})
    ]
    prompt = renderer.render(history, tools=tools, add_generation_prompt=False)
    assert prompt == "user:Weather in Paris?|assistant:get_weather(Paris)|tool:[call_1]18C|tools=get_weather"


def test_template_errors_are_400() -> None:
    renderer = ChatRenderer(smollm2_tokenizer(), "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(APIError) as caught:
        renderer.render(messages({"role": "user", "content": "x"}))
    assert caught.value.status == 400
    assert caught.value.message == "the chat template refused the messages: roles must alternate"


def test_no_template_is_a_clear_400() -> None:
    tokenizer = smollm2_tokenizer()
    renderer = ChatRenderer(tokenizer, None)
    renderer.template = None
    with pytest.raises(
        APIError, match="the model has no chat template: start the server with --chat-template"
    ):
        renderer.render(messages({"role": "user", "content": "x"}))


def test_continue_final_message_needs_an_assistant_message() -> None:
    renderer = ChatRenderer(smollm2_tokenizer(), None)
    with pytest.raises(APIError, match="needs an assistant message last"):
        renderer.render(
            messages({"role": "user", "content": "x"}),
            add_generation_prompt=False,
            continue_final_message=True,
        )
    prompt = renderer.render(
        messages({"role": "user", "content": "x"}, {"role": "assistant", "content": "The answer is"}),
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert prompt.endswith("<|im_start|>assistant\nThe answer is")


def test_load_chat_template_from_file_or_text(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert load_chat_template(str(path)) == "{{ messages[0].content }}"
    assert load_chat_template("{{ 'inline' }}") == "{{ 'inline' }}"
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="--chat-template 'missing.jinja' is not a file"):
        load_chat_template("missing.jinja")
