"""Lark grammars through llguidance: the rule that tells Lark from EBNF, the mask against brute force,
the state's contract (refusals leave it, the end only on a stop token, drafts), a batch mixing xgrammar
and llguidance rows, the refusals (offline and as a server 400), and greedy decoding through the whole
engine on the tiny model of test_structured_greedy.py against HF generate masked by llguidance's own
matcher (n > 1, beside xgrammar requests, and under speculative decoding with the oracle)."""

from __future__ import annotations

import functools
import json
import random
import re

import llguidance
import llguidance.hf
import pytest
import torch
from transformers import AutoTokenizer, LogitsProcessor

from fitserve import LLM, SamplingParams
from fitserve.structured import StructuredOutputsParams
from fitserve.structured.backend import GrammarState, validate
from fitserve.structured.batch_fill import MIN_BATCH_ROWS, fill_bitmasks
from fitserve.structured.bitmask import unpack_bitmask
from fitserve.structured.lark import LarkGrammarState
from fitserve.structured.manager import StructuredOutputManager
from fitserve.structured.params import looks_like_lark
from tests.paths import SMOLLM2_TOKENIZER_DIR
from tests.unit import test_structured_greedy as greedy
from tests.unit.server_helpers import build_test_client, smollm2_tokenizer
from tests.unit.test_structured_greedy import CONSTRAINTS, EOS, MAX_TOKENS, PROMPTS, VOCAB

# that file's module fixtures, shared: the tiny model and the xgrammar references
tiny_model = greedy.tiny_model
compiler = greedy.compiler
references = greedy.references

# Sums and products of up to four 1-2 digit numbers, spaces and tabs ignored between them: it ends within
# a few tokens whatever the model prefers.
ARITHMETIC = """
start: expr
?expr: term (OP term)~0..3
term: NUMBER
OP: "+" | "-" | "*"
NUMBER: /[0-9]{1,2}/
%import common.WS_INLINE
%ignore WS_INLINE
"""
ARITHMETIC_TEXT = re.compile(r"[ \t]*[0-9]{1,2}([ \t]*[-+*][ \t]*[0-9]{1,2}){0,3}[ \t]*")
# JSON-ish: an object of up to two short keys whose values are small numbers, booleans, null or a flat list.
JSONISH = """
start: object
object: "{" [pair ("," pair)~0..1] "}"
pair: KEY ":" value
?value: NUMBER | "true" | "false" | "null" | list
list: "[" [NUMBER ("," NUMBER)~0..2] "]"
KEY: /"[a-z]{1,4}"/
NUMBER: /-?(0|[1-9][0-9]{0,2})/
"""
# At most 23 characters, so sampled answers (n > 1) end within MAX_TOKENS too.
BOUNDED = """
start: term (OP term)~0..2
term: NUMBER | "(" NUMBER OP NUMBER ")"
OP: "+" | "-" | "*"
NUMBER: /[0-9]{1,2}/
"""
BOUNDED_TEXT = re.compile(r"(N|\(N[-+*]N\))([-+*](N|\(N[-+*]N\))){0,2}".replace("N", "[0-9]{1,2}"))
LARK = {
    "lark_arithmetic": StructuredOutputsParams(grammar=ARITHMETIC),
    "lark_json": StructuredOutputsParams(grammar=JSONISH),
}


@pytest.fixture(scope="module")
def manager() -> StructuredOutputManager:
    return StructuredOutputManager(smollm2_tokenizer(), VOCAB, frozenset({EOS}), preload=False)


def allowed_tokens(state, vocab_size: int = VOCAB) -> list[int]:
    bitmask = torch.zeros((1, state.bitmask_width), dtype=torch.int32)
    state.fill_bitmask(bitmask, 0)
    return unpack_bitmask(bitmask, vocab_size)[0].nonzero().flatten().tolist()


def encode(text: str) -> list[int]:
    return smollm2_tokenizer().encode(text, add_special_tokens=False)


# ---- which grammar is Lark -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("grammar", "lark"),
    [
        ('start: "a"', True),
        ("?start: x\nx: /[0-9]+/", True),
        ('  start.2 : "a"\n%ignore " "', True),
        ("!start: x\nx: NUMBER\n%import common.NUMBER", True),
        ('root ::= "a"', False),
        ('root ::= "a:b"\nx ::= "c"', False),
        ('start: "::="', False),  # the rule: any ::= reads as EBNF
        ('start:: "a"', False),
        ('%import common.NUMBER\n"start: a"', False),
    ],
)
def test_the_rule_that_reads_a_grammar_as_lark(grammar: str, lark: bool) -> None:
    assert looks_like_lark(grammar) is lark
    assert StructuredOutputsParams(grammar=grammar).to_spec().kind == ("lark" if lark else "grammar")


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        ("start: x", 'invalid Lark grammar: at line 1, column 8: unknown name: "x"'),
        ("start: 'a'", "invalid Lark grammar: at line 1, column 8: lexer error"),
        ('start: "a"\n%import common.NOPE', "Unknown common regex: common.NOPE"),
        ("hello world", "invalid grammar: as EBNF, EBNF parser error at line 1, column 1: The root rule"),
        ("hello world", "as Lark, at line 1, column 7: Expected token ':'"),
        ("root ::= missing", 'as EBNF, EBNF parser error at line 1, column 10: Rule "missing" is not'),
        ('start: "::="', "as Lark, valid, but it holds `::=`, which makes it EBNF"),
    ],
)
def test_bad_grammars_name_llguidance_reason_and_the_rule(grammar: str, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        validate(StructuredOutputsParams(grammar=grammar))
    text = str(raised.value)
    assert message in text, text
    assert "\n" not in text and "^" not in text  # llguidance's source excerpt is left out
    assert "a line starts with a rule definition `name:`" in text  # the rule, in the hint


def test_a_bad_lark_grammar_is_a_400_naming_the_reason() -> None:
    test_client, _ = build_test_client(lambda prompt, index: "Paris.", api_key="sk-test")
    with test_client:
        response = test_client.post(
            "/v1/completions",
            json={"prompt": "hi", "max_tokens": 2, "guided_grammar": "start: expr\nexpr: term"},
            headers={"Authorization": "Bearer sk-test"},
        )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "guided_grammar"
    assert 'invalid Lark grammar: at line 2, column 7: unknown name: "term"' in error["message"]


# ---- the state ---------------------------------------------------------------------------------------
def test_lark_mask_allows_exactly_the_tokens_the_grammar_accepts(manager: StructuredOutputManager) -> None:
    """The filled mask against brute force: a fresh state, advanced to the same place, tries every token
    of the vocabulary; at "12+" (mid-expression) and at "12 + 3" (complete: the stop token too)."""
    compiled = manager.compile_now(LARK["lark_arithmetic"])
    for text in ("12+", "12 + 3"):
        prefix = encode(text)
        state = manager.new_state(compiled)
        assert isinstance(state, LarkGrammarState)
        assert all(state.accept(token) for token in prefix)
        masked = allowed_tokens(state)
        reference = []
        for token in range(VOCAB):
            probe = manager.new_state(compiled)
            for t in prefix:
                probe.accept(t)
            if probe.accept(token):
                reference.append(token)
        assert masked == reference, text
        complete = text == "12 + 3"
        assert (EOS in masked) == complete and (encode("+")[0] in masked) == complete
        assert encode("7")[0] in masked and encode("x")[0] not in masked


def test_lark_state_refusals_drafts_and_the_end(manager: StructuredOutputManager) -> None:
    state = manager.new_state(manager.compile_now(StructuredOutputsParams(grammar='start: "yes" | "no"')))
    start = allowed_tokens(state)
    assert not state.accept(encode("maybe")[0]) and not state.accept(EOS)  # refused: the state stays
    assert state.num_accepted == 0 and allowed_tokens(state) == start
    yes = encode("yes")
    assert state.valid_prefix_len(yes + [EOS, EOS]) == len(yes) + 1  # nothing after the end
    assert state.valid_prefix_len(encode("nope")) == len(encode("no"))
    assert state.num_accepted == 0 and allowed_tokens(state) == start
    later = state.after(yes)
    assert later.num_accepted == len(yes) and allowed_tokens(later) == [EOS] and not later.is_terminated
    assert state.num_accepted == 0 and allowed_tokens(state) == start  # after() left it
    with pytest.raises(ValueError, match="refuses token"):
        state.after(encode("maybe"))
    # complete: only the stop token, and terminated only once it is taken (xgrammar's meaning)
    assert all(state.accept(token) for token in yes) and allowed_tokens(state) == [EOS]
    assert not state.is_terminated and state.accept(EOS) and state.is_terminated
    assert not state.accept(EOS) and state.num_accepted == len(yes) + 1
    # a row wider than the vocabulary's words: zero past them (llguidance writes exactly its words)
    wide = torch.full((2, state.bitmask_width + 3), -1, dtype=torch.int32)
    later.fill_bitmask(wide, 1)
    assert not wide[1, state.bitmask_width :].any() and (wide[0] == -1).all()
    assert unpack_bitmask(wide[1:], VOCAB)[0].nonzero().flatten().tolist() == [EOS]


def test_a_batch_mixing_xgrammar_and_lark_rows(manager: StructuredOutputManager) -> None:
    """fill_bitmasks over xgrammar and llguidance states in any order writes each row as the state's own
    fill does (xgrammar's rows batched from MIN_BATCH_ROWS of them on, the others one by one)."""
    compiled = [
        manager.compile_now(CONSTRAINTS["json"]),
        manager.compile_now(LARK["lark_json"]),
        manager.compile_now(CONSTRAINTS["regex"]),
        manager.compile_now(LARK["lark_arithmetic"]),
    ]
    rng = random.Random(0)
    states = []
    for index in range(2 * MIN_BATCH_ROWS + 3):
        state = manager.new_state(compiled[index % 4])
        for _ in range(rng.randrange(6)):
            allowed = [t for t in allowed_tokens(state) if t != EOS]
            if not allowed:
                break
            assert state.accept(rng.choice(allowed))
        states.append(state)
    assert {type(s) for s in states} == {GrammarState, LarkGrammarState}
    width = states[0].bitmask_width
    for chosen in (states[:3], states, [s for s in states if isinstance(s, LarkGrammarState)]):
        alone = torch.zeros((len(chosen), width), dtype=torch.int32)
        for row, state in enumerate(chosen):
            state.fill_bitmask(alone, row)
        batched = torch.full((len(chosen), width), -1, dtype=torch.int32)
        fill_bitmasks(chosen, batched)
        assert torch.equal(batched, alone)
    assert len({tuple(allowed_tokens(s)) for s in states}) > 4  # the rows differ: a mixed-up row would show


# ---- through the engine, against llguidance's own mask on HF logits ---------------------------------------
class LLGuidanceMask(LogitsProcessor):
    """HF generate's logits masked by an llguidance matcher of its own (fed the last token each step),
    through llguidance's byte-per-token logit bias: none of fitserve's code on this path."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self.matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))
        self.prompt_len: int | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prompt_len is None:
            self.prompt_len = input_ids.shape[1]
        else:
            assert self.matcher.consume_token(int(input_ids[0, -1])), self.matcher.get_error()
        bias = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8)
        allowed = torch.zeros(scores.shape[1], dtype=torch.bool)
        allowed[: min(len(bias), scores.shape[1])] = bias[: scores.shape[1]] > 0
        return scores.masked_fill(~allowed, -torch.inf)


@pytest.fixture(scope="module")
def lark_references(tiny_model, references):
    """The reference output of a (constraint name, prompt): Lark ones here, the others xgrammar's."""
    _, hf_model = tiny_model
    tokenizer = llguidance.hf.from_tokenizer(
        AutoTokenizer.from_pretrained(SMOLLM2_TOKENIZER_DIR), n_vocab=VOCAB, eos_token=[EOS]
    )

    @functools.cache
    def reference(name: str, prompt: tuple[int, ...]) -> list[int]:
        if name not in LARK:
            return references(name, prompt)
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                logits_processor=[LLGuidanceMask(tokenizer, LARK[name].grammar)],
                eos_token_id=EOS,
                pad_token_id=0,
            )
        output = out[0, len(prompt) :].tolist()
        return output[: output.index(EOS) + 1] if EOS in output else output

    return reference


def check_parses(name: str, text: str) -> None:
    if name == "lark_arithmetic":
        assert ARITHMETIC_TEXT.fullmatch(text), text
    else:
        value = json.loads(text)
        assert isinstance(value, dict) and len(value) <= 2, text


def llm(folder, **settings) -> LLM:
    return LLM(str(folder), dtype="float32", num_gpu_blocks_override=128, block_size=8, **settings)


def test_lark_greedy_beside_xgrammar_equals_the_references(tiny_model, lark_references) -> None:
    """Two Lark requests in one batch with four xgrammar ones (their rows batched by xgrammar) and a free
    one: each output is its reference's, the Lark ones complete and parse."""
    folder, _ = tiny_model
    requests = [(name, PROMPTS[0]) for name in LARK] + [("lark_json", PROMPTS[1])]
    requests += [(name, PROMPTS[0]) for name in CONSTRAINTS] + [(None, PROMPTS[2])]
    params = [
        SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, structured_outputs=(LARK | CONSTRAINTS).get(name)
        )
        for name, _ in requests
    ]
    outputs = llm(folder).generate([{"prompt_token_ids": p} for _, p in requests], params, use_tqdm=False)
    for (name, prompt), output in zip(requests, outputs, strict=True):
        (choice,) = output.outputs
        if name is None:
            continue
        assert choice.token_ids == lark_references(name, tuple(prompt)), (name, choice.text)
        if name in LARK:
            assert choice.finish_reason == "stop" and choice.token_ids[-1] == EOS, (name, choice.text)
            check_parses(name, choice.text)


@pytest.mark.parametrize("drafts", ["answers", "misses"])
def test_speculative_decoding_under_lark_equals_the_reference(tiny_model, lark_references, drafts) -> None:
    """The oracle drafting the reference answers has every draft accepted (a verify row masked by the
    wrong state, from LarkGrammarState.after, would sample another token); wrong drafts change nothing."""
    folder, _ = tiny_model
    requests = [("lark_arithmetic", PROMPTS[0]), ("lark_json", PROMPTS[1])]
    engine = llm(folder, speculative_config={"method": "oracle", "num_speculative_tokens": 3})
    expected = [lark_references(name, tuple(prompt)) for name, prompt in requests]
    prompts = [prompt for _, prompt in requests]
    engine.engine.speculator.proposer.load(prompts, expected, VOCAB, miss=drafts == "misses")
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=LARK[name])
        for name, _ in requests
    ]
    outputs = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = engine.engine.speculator.stats
    if drafts == "answers":
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    else:
        assert stats.num_accepted_tokens == 0


def test_n_lark_samples_each_follow_their_own_matcher(tiny_model) -> None:
    folder, _ = tiny_model
    grammar = StructuredOutputsParams(grammar=BOUNDED)
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=MAX_TOKENS, structured_outputs=grammar)
    (output,) = llm(folder).generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    texts = [choice.text for choice in output.outputs]
    for choice in output.outputs:
        assert choice.finish_reason == "stop" and BOUNDED_TEXT.fullmatch(choice.text), texts
    assert len(set(texts)) > 1  # four samples, each from its own matcher and draws
