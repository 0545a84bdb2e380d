"""Beam search (fitserve/engine/beam_search.py): the algorithm on hand-made distributions, `LLM.beam_search`
on a tiny random model against a brute-force reference built from HF's logprobs, and the server's
`use_beam_search` on a real tiny engine."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fitserve import BeamSearchParams, SamplingParams
from fitserve.engine.beam_search import BeamSearch, beam_search_score
from tests.model_folders import save_with_tokenizer
from tests.unit.model_helpers import build_hf_model, tiny_hf_config
from tests.unit.server_helpers import smollm2_tokenizer
from tests.unit.test_engine_vs_hf import make_llm, save_tiny_model

PROMPT = [5, 17, 33, 88, 90]
EOS = 2


# ---- the algorithm, on hand-made distributions ---------------------------------------------------------


def run_fake(search: BeamSearch, table: dict[tuple[int, ...], dict[int, float]]) -> None:
    """Drives `search` with next-token logprobs looked up by the generated tokens so far."""
    while not search.done:
        start = len(search.prompt_token_ids)
        search.advance([list(table[tuple(tokens[start:])].items()) for tokens in search.pending()])


def test_eos_finishes_a_beam_and_length_penalty_ranks_the_finished():
    lp = math.log
    table = {
        (): {10: lp(0.5), EOS: lp(0.3), 11: lp(0.2)},
        (10,): {12: lp(0.9), 13: lp(0.1)},
        (11,): {12: lp(0.6), 14: lp(0.4)},
    }
    params = BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=0.0)
    search = BeamSearch([1, 1], params, {EOS}, max_model_len=100)
    run_fake(search, table)
    out = search.output(lambda ids: " ".join(map(str, ids)))
    got = [(s.output_token_ids, round(s.cum_logprob, 6), s.finish_reason, s.text) for s in out.sequences]
    # by cumulative logprob: 10,12 (0.45) > EOS (0.3) > 10,13 (0.05) ...; two returned, best first
    assert got == [
        ([10, 12], round(lp(0.45), 6), "length", "10 12"),
        ([EOS], round(lp(0.3), 6), "stop", ""),  # the end-of-sequence token is left out of the text
    ]
    assert out.sequences[0].tokens == [1, 1, 10, 12]  # vLLM: tokens hold the prompt too


def test_length_penalty_divides_by_the_length_without_a_final_eos():
    assert beam_search_score([1, 2, 3, EOS], -6.0, {EOS}, 1.0) == pytest.approx(-2.0)
    assert beam_search_score([1, 2, 3, 4], -6.0, {EOS}, 2.0) == pytest.approx(-6.0 / 16)
    lp = math.log
    table = {(): {EOS: lp(0.4), 10: lp(0.6)}, (10,): {11: lp(0.5), 12: lp(0.5)}}
    # EOS alone: -0.92 over length 1 (prompt 1, eos not counted); 10,11: -1.20 over length 3
    search = BeamSearch([1], BeamSearchParams(beam_width=1, max_tokens=2), {EOS}, max_model_len=100)
    run_fake(search, table)
    assert search.output(str).sequences[0].output_token_ids == [10, 11]
    search = BeamSearch([1], BeamSearchParams(beam_width=1, max_tokens=2, length_penalty=0.0), {EOS}, 100)
    run_fake(search, table)
    assert search.output(str).sequences[0].output_token_ids == [EOS]


def test_ignore_eos_and_include_stop_str_and_max_model_len():
    lp = math.log
    table = {(): {EOS: lp(0.9), 10: lp(0.1)}, (EOS,): {11: 0.0}, (10,): {11: 0.0}}
    params = BeamSearchParams(beam_width=1, max_tokens=5, ignore_eos=True)
    search = BeamSearch([1], params, {EOS}, max_model_len=3)  # room for 2 tokens
    run_fake(search, table)
    (best,) = search.output(str).sequences
    assert best.output_token_ids == [EOS, 11] and best.finish_reason == "length"
    params = BeamSearchParams(beam_width=1, max_tokens=5, include_stop_str_in_output=True)
    search = BeamSearch([1], params, {EOS}, max_model_len=100)
    run_fake(search, {(): {EOS: 0.0}})
    assert search.output(str).sequences[0].text == str([EOS])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
        ({"beam_width": 2, "max_tokens": 4, "temperature": -1.0}, "temperature"),
        ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, "length_penalty"),
    ],
)
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**kwargs)


# ---- LLM.beam_search on a tiny random model --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("beam")
    return folder, save_tiny_model(folder, "LlamaForCausalLM")


@pytest.fixture(scope="module")
def llm(tiny):
    return make_llm(tiny[0])


def reference_beam_search(model, prompt: list[int], width: int, steps: int) -> list[tuple[list[int], float]]:
    """Beam search by definition (ignore_eos, length_penalty 0), brute force over the whole vocabulary with
    HF's float64 logprobs: each step extends every live beam by every token and keeps the `width` best."""
    live = [([], 0.0)]
    with torch.no_grad():
        for _ in range(steps):
            batch = torch.tensor([prompt + tokens for tokens, _ in live])
            logprobs = torch.log_softmax(model(input_ids=batch).logits[:, -1].double(), dim=-1)
            candidates = [
                (tokens + [token], cum + logprobs[i, token].item())
                for i, (tokens, cum) in enumerate(live)
                for token in range(logprobs.shape[-1])
            ]
            live = sorted(candidates, key=lambda c: c[1], reverse=True)[:width]
    return live


def test_beam_width_one_is_greedy(llm):
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": list(range(40, 60))}]
    greedy = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0), use_tqdm=False
    )
    beams = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
    for sampled, searched in zip(greedy, beams, strict=True):
        (best,) = searched.sequences
        assert best.output_token_ids == sampled.outputs[0].token_ids
        assert best.cumulative_logprob == pytest.approx(sampled.outputs[0].cumulative_logprob, abs=1e-4)
        assert best.text == llm.get_tokenizer().decode(best.output_token_ids)


@pytest.mark.parametrize("width, steps", [(3, 2), (4, 3)])
def test_matches_a_brute_force_search(tiny, llm, width, steps):
    _folder, model = tiny
    expected = reference_beam_search(model, PROMPT, width, steps)
    params = BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True, length_penalty=0.0)
    (out,) = llm.beam_search({"prompt_token_ids": PROMPT}, params)
    assert [s.output_token_ids for s in out.sequences] == [tokens for tokens, _ in expected]
    for sequence, (_tokens, cum) in zip(out.sequences, expected, strict=True):
        assert sequence.cum_logprob == pytest.approx(cum, abs=1e-3)
        assert sequence.finish_reason == "length"


def test_matches_transformers_generate_num_beams(tiny, llm):
    """HF's beam search, with eos held off (min_new_tokens) and no length penalty, ranks the same way."""
    _folder, model = tiny
    with torch.no_grad():
        hf = model.generate(
            torch.tensor([PROMPT]),
            num_beams=4,
            num_return_sequences=4,
            max_new_tokens=3,
            min_new_tokens=3,
            do_sample=False,
            length_penalty=0.0,
            early_stopping=True,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    params = BeamSearchParams(beam_width=4, max_tokens=3, ignore_eos=True, length_penalty=0.0)
    (out,) = llm.beam_search({"prompt_token_ids": PROMPT}, params)
    assert [s.output_token_ids for s in out.sequences] == hf.sequences[:, len(PROMPT) :].tolist()
    assert [s.cum_logprob for s in out.sequences] == pytest.approx(hf.sequences_scores.tolist(), abs=1e-3)


def test_two_token_search_keeps_the_best_of_every_pair(tiny, llm):
    """Exhaustive over every 2-token continuation of the top-`width` first tokens (what a width-`width`
    search may reach): the search returns exactly the best `width` of them, best first."""
    _folder, model = tiny
    width = 3
    with torch.no_grad():
        first = torch.log_softmax(model(input_ids=torch.tensor([PROMPT])).logits[0, -1].double(), dim=-1)
        vocab = first.shape[0]
        top_first = torch.topk(first, width).indices.tolist()
        every = torch.tensor([PROMPT + [a, b] for a in top_first for b in range(vocab)])
        second = torch.log_softmax(model(input_ids=every[:, :-1]).logits[:, -1].double(), dim=-1)
    scored = [
        ([a, b], first[a].item() + second[i * vocab + b, b].item())
        for i, a in enumerate(top_first)
        for b in range(vocab)
    ]
    best = sorted(scored, key=lambda s: s[1], reverse=True)[:width]
    params = BeamSearchParams(beam_width=width, max_tokens=2, ignore_eos=True, length_penalty=0.0)
    (out,) = llm.beam_search([{"prompt_token_ids": PROMPT}], params)
    assert [s.output_token_ids for s in out.sequences] == [tokens for tokens, _ in best]
    assert [s.cum_logprob for s in out.sequences] == pytest.approx([c for _, c in best], abs=1e-3)


def test_default_length_penalty_ranks_by_score(llm):
    params = BeamSearchParams(beam_width=3, max_tokens=3)
    (out,) = llm.beam_search({"prompt_token_ids": PROMPT}, params)
    scores = [
        beam_search_score(s.tokens, s.cum_logprob, llm.engine.eos_token_ids, 1.0) for s in out.sequences
    ]
    assert scores == sorted(scores, reverse=True) and len(out.sequences) == 3
    assert not llm.engine.has_unfinished_requests()


def test_too_wide_a_beam_is_refused(llm):
    with pytest.raises(ValueError, match=r"beam_width=200 is above the limit 128"):
        llm.beam_search("Hello", BeamSearchParams(beam_width=200, max_tokens=2))


# ---- the server, on a real tiny engine ----------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """A tiny random model with SmolLM2's whole vocabulary, so chat templates' tokens fit it."""
    config = tiny_hf_config("LlamaForCausalLM", vocab_size=len(smollm2_tokenizer()))
    return save_with_tokenizer(build_hf_model(config, seed=5), tmp_path_factory.mktemp("beam-chat"))


@pytest.fixture(scope="module")
def client(chat_model):
    from fastapi.testclient import TestClient

    from fitserve.engine.async_engine import AsyncEngine
    from fitserve.server.app import build_app
    from fitserve.server.args import ServerSettings

    engine = make_llm(chat_model).engine
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    app = build_app(AsyncEngine(engine, log_stats=False), ServerSettings(chat_template=template))
    with TestClient(app) as test_client:
        yield test_client, engine


def test_completions_beam_search_returns_n_beams_best_first(client):
    test_client, engine = client
    body = {"prompt": PROMPT, "use_beam_search": True, "n": 3, "max_tokens": 3, "ignore_eos": True}
    response = test_client.post("/v1/completions", json={**body, "length_penalty": 0.0})
    assert response.status_code == 200, response.text
    data = response.json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert {c["finish_reason"] for c in data["choices"]} == {"length"}
    usage = data["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (5, 9, 14)
    # the same search offline gives the same texts, in the same order
    offline = make_llm_like(engine).beam_search(
        {"prompt_token_ids": PROMPT},
        BeamSearchParams(beam_width=3, max_tokens=3, ignore_eos=True, length_penalty=0.0),
    )[0]
    assert [c["text"] for c in data["choices"]] == [s.text for s in offline.sequences]
    assert not engine.has_unfinished_requests()


def make_llm_like(engine):
    from fitserve.engine.llm import LLM

    llm = LLM.__new__(LLM)
    llm.engine, llm._next_request_id = engine, 10_000
    return llm


def test_chat_beam_search_and_stream(client):
    test_client, _engine = client
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "use_beam_search": True,
        "n": 2,
        "max_tokens": 2,
        "ignore_eos": True,
    }
    response = test_client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    full = [c["message"]["content"] for c in choices]
    streamed = test_client.post("/v1/chat/completions", json={**body, "stream": True})
    assert streamed.status_code == 200
    from tests.unit.server_helpers import sse_payloads

    texts = ["", ""]
    for payload in sse_payloads(streamed.text):
        if isinstance(payload, dict):
            for choice in payload.get("choices", []):
                texts[choice["index"]] += choice["delta"].get("content") or ""
    assert texts == full


@pytest.mark.parametrize(
    "extra, field, words",
    [
        ({"n": 0}, "n", ["n=0", "1 or more"]),
        ({"n": 30_000}, "n", ["30000", "limit"]),
        ({"n": 2, "stop": ["x"]}, "stop", ["not used by beam search", "use_beam_search to false"]),
        ({"n": 2, "top_p": 0.5}, "top_p", ["top_p=0.5"]),
        ({"n": 2, "logprobs": 2}, "logprobs", ["logprobs=2"]),
        ({"n": 2, "use_beam_search": False, "length_penalty": 2.0}, "length_penalty", ["beam search"]),
    ],
)
def test_bad_beam_search_requests_are_400s(client, extra, field, words):
    test_client, _engine = client
    body = {"prompt": PROMPT, "use_beam_search": True, "max_tokens": 2} | extra
    response = test_client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field
    for word in words:
        assert word in error["message"]


def test_closing_a_beam_search_stream_aborts_its_requests(llm):
    import asyncio

    from fitserve.engine.async_engine import AsyncEngine
    from fitserve.engine.beam_search import BeamSearchStream

    async def start_then_close() -> tuple[int, bool]:
        engine = AsyncEngine(llm.engine, log_stats=False)
        await engine.start()
        params = BeamSearchParams(beam_width=2, max_tokens=400, ignore_eos=True)
        stream = BeamSearchStream(engine, "closed", None, PROMPT, params)
        await asyncio.sleep(0.05)
        stream.close()
        with pytest.raises(asyncio.CancelledError):
            await stream.final_output()
        await asyncio.sleep(0.1)
        in_flight = engine.num_in_flight
        await engine.shutdown()
        return in_flight, stream.finished

    assert asyncio.run(start_then_close()) == (0, True)
    assert not llm.engine.has_unfinished_requests()
