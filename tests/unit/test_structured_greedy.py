"""Greedy decoding under a grammar, through the whole engine (LLM.generate: compile pool, scheduler,
sampler masks, matcher advance, stop on the grammar's end) against the grammar engine's own reference:
HF transformers' greedy generate with xgrammar's logits processor (each step: the matcher's bitmask
on the logits, the argmax, the matcher fed). A tiny random Llama with the SmolLM2 tokenizer and its
full 49,152-token vocabulary; also the engine in its own process, n > 1, and bad_words."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
import torch
import xgrammar as xgr
import xgrammar.contrib.hf
from transformers import AutoTokenizer

from fitserve import LLM, SamplingParams
from fitserve.args import EngineArgs
from fitserve.engine.async_engine import AsyncEngine
from fitserve.engine.engine_process import EngineProcess
from fitserve.structured import StructuredOutputsParams
from tests.model_folders import save_with_tokenizer
from tests.paths import SMOLLM2_TOKENIZER_DIR
from tests.unit.model_helpers import build_hf_model, tiny_hf_config
from tests.unit.test_engine_process import LoopThread

VOCAB = 49152
EOS = 2  # the tiny config's eos_token_id, and the SmolLM2 tokenizer's <|im_end|>
MAX_TOKENS = 48
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"type": "string", "enum": ["S", "M", "L"]},
        "count": {"type": "integer", "minimum": -9, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "size", "count", "tags"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=r"[a-f]{2,5}-[0-9]{1,3}"),
    "choice": StructuredOutputsParams(choice=["alpha", "beta", "gamma delta"]),
    "grammar": StructuredOutputsParams(grammar='root ::= "(" num ("+" num)? ")"\nnum ::= [0-9] [0-9]?'),
}
PROMPTS = [[5, 17, 33, 90, 1200], list(range(300, 340)), [4000, 3, 3, 9, 25000, 11]]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("tiny-llama-structured")
    config = tiny_hf_config("LlamaForCausalLM", vocab_size=VOCAB, eos_token_id=EOS)
    model = build_hf_model(config, seed=5)
    save_with_tokenizer(model, folder)
    return folder, model


@pytest.fixture(scope="module")
def references(tiny_model, compiler) -> dict:
    """The reference output of every (constraint name, prompt) (None: unconstrained), made once."""
    _, hf_model = tiny_model

    @functools.cache
    def reference(name: str | None, prompt: tuple[int, ...]) -> list[int]:
        compiled = reference_compile(compiler, CONSTRAINTS[name]) if name else None
        return reference_greedy(hf_model, compiled, list(prompt))

    return reference


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_TOKENIZER_DIR)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB, stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info)


def reference_compile(compiler: xgr.GrammarCompiler, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
    if params.json is not None:
        return compiler.compile_json_schema(
            json.dumps(params.json), any_whitespace=False, separators=(", ", ": ")
        )
    if params.regex is not None:
        return compiler.compile_regex(params.regex)
    if params.choice is not None:
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in params.choice))
    return compiler.compile_grammar(params.grammar)


def reference_greedy(
    model: torch.nn.Module, compiled: xgr.CompiledGrammar | None, prompt: list[int]
) -> list[int]:
    """HF transformers' greedy generate with xgrammar's own logits processor (a new one per call: it
    keeps its matchers), up to and including the end-of-sequence token."""
    processors = [xgr.contrib.hf.LogitsProcessor(compiled)] if compiled is not None else []
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            logits_processor=processors,
            eos_token_id=EOS,
            pad_token_id=0,
        )
    output = out[0, len(prompt) :].tolist()
    return output[: output.index(EOS) + 1] if EOS in output else output


@pytest.mark.parametrize("variant", [{}, {"max_num_batched_tokens": 8, "max_num_seqs": 4}])
def test_greedy_with_grammars_equals_the_reference(tiny_model, references, variant) -> None:
    folder, _ = tiny_model
    llm = LLM(str(folder), dtype="float32", num_gpu_blocks_override=128, block_size=8, **variant)
    requests = [("json", PROMPTS[1])] + [(name, PROMPTS[0]) for name in CONSTRAINTS] + [(None, PROMPTS[2])]
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS.get(name))
        for name, _ in requests
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for _, p in requests], params, use_tqdm=False)
    for (name, prompt), output in zip(requests, outputs, strict=True):
        expected = references(name, tuple(prompt))
        (choice,) = output.outputs
        assert choice.token_ids == expected, (name, choice.text)
        if name is not None and len(expected) < MAX_TOKENS:
            assert choice.finish_reason == "stop" and expected[-1] == EOS
        if name == "json" and choice.finish_reason == "stop":
            json.loads(choice.text)


@pytest.mark.parametrize("drafts", ["answers", "misses", "ngram"])
def test_speculative_decoding_under_grammars_equals_the_reference(tiny_model, references, drafts) -> None:
    """Drafts for constrained requests: cut to what the grammar accepts, each verify row masked by the
    grammar after the drafts before it. The oracle drafting the reference answers has every draft
    accepted (a verify row masked by the wrong state would sample another token); drafting tokens that
    are never the answer's, and prompt lookup, leave the output exact too."""
    folder, _ = tiny_model
    requests = [(name, PROMPTS[0]) for name in CONSTRAINTS] + [("json", PROMPTS[1])]
    method = "ngram" if drafts == "ngram" else "oracle"
    config = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        config.update(prompt_lookup_min=1, prompt_lookup_max=3)
    llm = LLM(
        str(folder), dtype="float32", num_gpu_blocks_override=128, block_size=8, speculative_config=config
    )
    expected = [references(name, tuple(prompt)) for name, prompt in requests]
    if method == "oracle":  # one request per prompt: the oracle keys its answers by prompt
        requests, expected = [requests[0], requests[-1]], [expected[0], expected[-1]]
        prompts = [prompt for _, prompt in requests]
        llm.engine.speculator.proposer.load(prompts, expected, VOCAB, miss=drafts == "misses")
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS[name])
        for name, _ in requests
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for _, p in requests], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.engine.speculator.stats
    if drafts == "answers":
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    if drafts == "misses":
        assert stats.num_accepted_tokens == 0


def test_n_samples_each_follow_their_own_matcher(tiny_model) -> None:
    folder, _ = tiny_model
    llm = LLM(str(folder), dtype="float32", num_gpu_blocks_override=128, block_size=8)
    params = SamplingParams(
        n=4, temperature=1.0, seed=11, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS["regex"]
    )
    (output,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    texts = [choice.text for choice in output.outputs]
    assert all(re.fullmatch(r"[a-f]{2,5}-[0-9]{1,3}", text) for text in texts), texts
    assert all(choice.finish_reason == "stop" for choice in output.outputs)
    assert len(set(texts)) > 1  # four samples, each from its own matcher and draws


def test_engine_process_serves_constraints_and_refuses_bad_ones(tiny_model, references) -> None:
    """The GPU layout: the engine in a process of its own (params cross the pipe), streaming."""
    folder, _ = tiny_model
    args = EngineArgs(
        model=str(folder), dtype="float32", num_gpu_blocks_override=128, block_size=8, device="cpu"
    )
    loop = LoopThread()
    engine = AsyncEngine(EngineProcess.start(args), log_stats=False)
    loop.run(engine.start())
    try:

        async def run(name: str) -> list:
            params = SamplingParams(
                temperature=0, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS[name]
            )
            return [output async for output in engine.generate(f"p-{name}", None, PROMPTS[0], params)]

        for name in ("json", "choice"):
            outputs = loop.run(run(name), timeout_s=120)
            assert outputs[-1].outputs[0].token_ids == references(name, tuple(PROMPTS[0]))
            texts = [output.outputs[0].text for output in outputs]
            assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))

        async def bad() -> None:
            params = SamplingParams(structured_outputs={"regex": "(ab"})
            await engine.add_request("bad", None, PROMPTS[0], params)

        with pytest.raises(ValueError, match="invalid regex"):
            loop.run(bad())
        assert engine.is_healthy and engine.num_in_flight == 0
    finally:
        loop.run(engine.shutdown())
        loop.close()


def test_bad_words_leave_the_greedy_output(tiny_model) -> None:
    """A word of the unconstrained greedy output, banned: the engine turns it into token ids and the
    sampler never picks them again."""
    folder, _ = tiny_model
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_TOKENIZER_DIR)
    llm = LLM(str(folder), dtype="float32", num_gpu_blocks_override=128, block_size=8)
    prompt = {"prompt_token_ids": PROMPTS[1]}
    (plain,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    tokens = plain.outputs[0].token_ids

    def one_token_spellings(word: str) -> set[int]:
        probe = SamplingParams(bad_words=[word])
        probe.update_from_tokenizer(tokenizer)
        return {ids[0] for ids in probe.bad_words_token_ids if len(ids) == 1}

    word, banned_ids = next(
        (text, one_token_spellings(text))
        for text in (tokenizer.decode([t]).strip() for t in tokens)
        if text.isalpha() and one_token_spellings(text).intersection(tokens)
    )
    params = SamplingParams(temperature=0, max_tokens=24, bad_words=[word])
    (banned,) = llm.generate([prompt], params, use_tqdm=False)
    assert not banned_ids.intersection(banned.outputs[0].token_ids), (word, banned.outputs[0].text)
    assert banned.outputs[0].token_ids != tokens
