"""The offline surfaces of a step that ran out of GPU memory: LLM.generate / LLM.chat return the failed
requests with finish_reason "error" and `.error` (the engine logs the message; LLM adds one line counting
them) and the others complete; `fitserve generate` prints the message and exits 1."""

from __future__ import annotations

import pytest

from fitserve.cli.generate import print_answers
from fitserve.core.sampling_params import SamplingParams
from fitserve.engine.llm import LLM
from tests.unit.oom_replay import OutOfMemoryReplayEngine

LONG = "one two three four five six seven eight nine ten eleven twelve"


def llm_over(engine: OutOfMemoryReplayEngine) -> LLM:
    llm = LLM.__new__(LLM)
    llm.engine = engine  # type: ignore[assignment]
    llm._next_request_id = 0
    return llm


def failing_engine() -> OutOfMemoryReplayEngine:
    return OutOfMemoryReplayEngine(lambda prompt, index: LONG, fails=lambda prompt: "Explode" in prompt)


def test_generate_returns_failed_requests_with_their_error_and_completes_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = failing_engine()
    prompts = ["Hello", "Explode here", "Explode there", "Goodbye"]
    with caplog.at_level("WARNING", logger="fitserve"):
        outputs = llm_over(engine).generate(prompts, SamplingParams(max_tokens=40), use_tqdm=False)
    assert [o.request_id for o in outputs] == ["0", "1", "2", "3"]
    for output in (outputs[0], outputs[3]):
        assert output.error is None and output.outputs[0].text == LONG
        assert output.outputs[0].finish_reason == "stop"
    for output in outputs[1:3]:
        assert output.finished and output.outputs[0].finish_reason == "error"
        assert output.error is not None and "--max-num-batched-tokens 4096 (now 8192" in output.error
    assert engine.failed_steps == [(["1", "2"], ["0", "3"])]  # one step failed both; nothing was lost
    logged = [r.getMessage() for r in caplog.records if "ended with an error" in r.getMessage()]
    assert logged == [
        '2 of 4 request(s) ended with an error (finish_reason "error"; the message is in their output\'s '
        ".error): 1, 2"
    ]


def test_chat_returns_the_error_too() -> None:
    engine = failing_engine()
    conversations = [[{"role": "user", "content": "Explode"}], [{"role": "user", "content": "Hi"}]]
    outputs = llm_over(engine).chat(conversations, SamplingParams(max_tokens=40), use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason == "error" and outputs[0].error
    assert outputs[1].outputs[0].text == LONG


def test_fitserve_generate_prints_the_message_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    engine = failing_engine()
    prompts = ["Hello", "Explode"]
    outputs = llm_over(engine).generate(prompts, SamplingParams(max_tokens=40), use_tqdm=False)
    assert print_answers(prompts, outputs, engine.tokenizer) == 1
    printed = capsys.readouterr()
    assert printed.out == f"Prompt: Hello\n{LONG}\nPrompt: Explode\n"
    assert f"Error: {outputs[1].error}\n" in printed.err
    assert printed.err.endswith("fitserve generate: 1 of 2 prompt(s) failed (see above)\n")
    assert print_answers(prompts[:1], outputs[:1], engine.tokenizer) == 0
