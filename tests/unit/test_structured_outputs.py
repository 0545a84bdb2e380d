"""Structured outputs without a model: request parameters and their errors, grammar compilation and its
cache, the bitmask unpack against a Python loop, the sampler's masking of constrained rows only, the
engine-side manager (n > 1, termination, refusal), tool_choice schemas and the forced tool-call
parsers, and the backend flags."""

from __future__ import annotations

import json
import random
import time

import jsonschema
import pytest
import torch

from fitserve.core.request import Request
from fitserve.core.sampling_params import SamplingParams
from fitserve.server.parsers.forced_tools import NamedToolParser, RequiredToolsParser
from fitserve.structured import GuidedDecodingParams, StructuredOutputsParams
from fitserve.structured.backend import validate
from fitserve.structured.bitmask import apply_bitmask_rows, unpack_bitmask
from fitserve.structured.flags import check_structured_outputs_flags
from fitserve.structured.manager import StructuredOutputManager
from fitserve.structured.tools import named_tool_schema, required_tools_schema
from fitserve.worker.sampler import Sampler, SamplingRow
from tests.unit.server_helpers import smollm2_tokenizer

VOCAB = 49152  # SmolLM2's
EOS = 2  # <|im_end|>
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def manager() -> StructuredOutputManager:
    return StructuredOutputManager(smollm2_tokenizer(), VOCAB, frozenset({EOS}))


# ---- parameters and their errors ---------------------------------------------------------------------
def test_params_take_one_constraint_and_normalise() -> None:
    params = SamplingParams(structured_outputs={"json": json.dumps(SCHEMA)})
    assert isinstance(params.structured_outputs, StructuredOutputsParams)
    assert params.structured_outputs.kind == "json"
    assert params.structured_outputs.to_spec().spec == json.dumps(SCHEMA)
    older = SamplingParams(guided_decoding=GuidedDecodingParams(regex="[a-z]+"))
    assert older.structured_outputs.kind == "regex" and older.guided_decoding is None
    assert StructuredOutputsParams(choice=["a", "b"]).to_spec().spec == 'root ::= "a" | "b"'
    assert StructuredOutputsParams(json_object=True).to_spec().kind == "json_object"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "asks for nothing: set exactly one of json"),
        ({"regex": "a", "choice": ["a"]}, "sets 2 constraints (regex, choice)"),
        ({"choice": []}, "choice is an empty list"),
        ({"choice": ["a", ""]}, "every choice must be a non-empty string"),
        ({"json": "{not json"}, "the JSON schema is not valid JSON"),
        ({"json": [1, 2]}, "the JSON schema must be an object, not list"),
        ({"json": False}, "the JSON schema is false"),
        ({"json": {"type": "object", "properties": {"a": {"not": {}}}}}, "uses 'not' at #/properties/a"),
        ({"json": {"type": "array", "uniqueItems": True}}, "uses 'uniqueItems' at #"),
        ({"json": {"type": "nonsense"}}, 'invalid JSON schema: Unsupported type "nonsense"'),
        ({"json": {"$ref": "#/$defs/missing"}}, "invalid JSON schema"),
        ({"regex": "(ab"}, "invalid regex: Regex parsing error at position 4: The parenthesis is not closed"),
        ({"regex": "(?<=a)b"}, "Lookbehind is not supported"),
        (
            {"grammar": "root ::= missing"},
            'invalid grammar: as EBNF, EBNF parser error at line 1, column 10: Rule "missing"',
        ),
        ({"grammar": "start: 'a'"}, "invalid Lark grammar: at line 1, column 8: lexer error"),
        ({"regex": "a", "backend": "outlines"}, "backend='outlines' is not available in fitserve"),
        ({"regex": "a", "backend": "magic"}, "backend='magic' is not a structured-output backend"),
        ({"regex": "a", "whitespace_pattern": r"\s*"}, "whitespace_pattern"),
        ({"structural_tag": "{}"}, "structural_tag is not supported"),
    ],
)
def test_bad_constraints_raise_naming_the_problem(fields: dict, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        validate(StructuredOutputsParams(**fields))
    assert message in str(raised.value)
    assert ".cc:" not in str(raised.value)  # no C++ timestamp / source position left


def test_sampling_params_refuse_both_names_and_unknown_keys() -> None:
    with pytest.raises(ValueError, match="both set"):
        SamplingParams(structured_outputs={"regex": "a"}, guided_decoding={"regex": "b"})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['jsn'\]"):
        SamplingParams(structured_outputs={"jsn": {}})


def test_backend_flags() -> None:
    check_structured_outputs_flags({"backend": "xgrammar"}, "auto")
    check_structured_outputs_flags('{"backend": "auto"}', None)
    with pytest.raises(
        ValueError, match="--guided-decoding-backend='guidance' is not available.*auto, xgrammar"
    ):
        check_structured_outputs_flags(None, "guidance")
    with pytest.raises(ValueError, match=r"key\(s\) \['disable_fallback'\] fitserve does not take"):
        check_structured_outputs_flags({"disable_fallback": True}, None)
    with pytest.raises(ValueError, match="is not JSON"):
        check_structured_outputs_flags("{backend", None)


# ---- the bitmask ---------------------------------------------------------------------------------------
def reference_unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    allowed = torch.zeros((bitmask.shape[0], vocab_size), dtype=torch.bool)
    for row in range(bitmask.shape[0]):
        for token in range(vocab_size):
            word = int(bitmask[row, token // 32]) & 0xFFFFFFFF
            allowed[row, token] = bool((word >> (token % 32)) & 1)
    return allowed


@pytest.mark.parametrize("vocab_size", [32, 100, 200])
def test_unpack_matches_a_python_loop(vocab_size: int) -> None:
    generator = torch.Generator().manual_seed(vocab_size)
    words = -(-vocab_size // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=generator)
    bitmask[0] = -1  # every bit set, the sign bit included
    bitmask[1, 0] = 0
    assert torch.equal(unpack_bitmask(bitmask, vocab_size), reference_unpack(bitmask, vocab_size))
    # a vocabulary wider than the words: the tokens past them are not allowed
    wider = unpack_bitmask(bitmask, words * 32 + 5)
    assert not wider[:, words * 32 :].any()


def test_apply_bitmask_rows_touches_only_the_given_rows() -> None:
    logits = torch.randn(4, 70)
    before = logits.clone()
    bitmask = torch.zeros((2, 3), dtype=torch.int32)
    bitmask[0, 0] = 0b1010  # tokens 1 and 3
    bitmask[1, 2] = 1  # token 64
    apply_bitmask_rows(logits, bitmask, [1, 3])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [1, 3]
    assert torch.isfinite(logits[3]).nonzero().flatten().tolist() == [64]
    assert logits[1, 3] == before[1, 3]


# ---- compiling, the cache, the mask against the matcher --------------------------------------------------
def test_compile_cache_hits_and_key_order(manager: StructuredOutputManager) -> None:
    hits, misses = manager.cache_hits, manager.cache_misses
    first = manager.submit(StructuredOutputsParams(json=SCHEMA))
    again = manager.submit(StructuredOutputsParams(json=json.dumps(SCHEMA)))
    assert again is first and manager.cache_hits == hits + 1 and manager.cache_misses == misses + 1
    compiled = first.result(timeout=60)
    started = time.perf_counter()
    assert manager.compile_now(StructuredOutputsParams(json=SCHEMA)) is compiled
    assert time.perf_counter() - started < 0.05
    # the properties' order is the output's order: another order is another grammar
    reordered = {**SCHEMA, "properties": dict(reversed(list(SCHEMA["properties"].items())))}
    assert manager.submit(StructuredOutputsParams(json=reordered)) is not first
    assert manager.submit(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)) is not first


def allowed_tokens(state, vocab_size: int = VOCAB) -> list[int]:
    bitmask = torch.zeros((1, state.bitmask_width), dtype=torch.int32)
    state.fill_bitmask(bitmask, 0)
    return unpack_bitmask(bitmask, vocab_size)[0].nonzero().flatten().tolist()


def test_mask_allows_exactly_the_tokens_the_grammar_accepts(manager: StructuredOutputManager) -> None:
    """The filled mask against a brute-force reference: a fresh matcher, advanced to the same place,
    tries every token of the vocabulary one by one."""
    tokenizer = smollm2_tokenizer()
    compiled = manager.compile_now(StructuredOutputsParams(regex=r"(cat|car|dog)s? [0-9]{1,2}"))
    prefix = tokenizer.encode("ca", add_special_tokens=False)
    state = manager.new_state(compiled)
    for token in prefix:
        assert state.accept(token)
    masked = allowed_tokens(state)
    reference = []
    for token in range(len(tokenizer)):
        probe = manager.new_state(compiled)
        for t in prefix:
            probe.accept(t)
        if probe.accept(token):
            reference.append(token)
    assert masked == reference
    assert tokenizer.encode("t", add_special_tokens=False)[0] in masked
    assert tokenizer.encode("o", add_special_tokens=False)[0] not in masked


def test_batch_fill_equals_each_row_filled_alone(manager: StructuredOutputManager) -> None:
    """batch_fill.fill_bitmasks (xgrammar's threads from MIN_BATCH_ROWS rows on) writes every row as the
    state's own fill does, for states of different grammars at different places (none complete: the
    sampler masks only unfinished ones)."""
    from fitserve.structured.batch_fill import MIN_BATCH_ROWS, fill_bitmasks

    schema = manager.compile_now(StructuredOutputsParams(json=SCHEMA))
    choice = manager.compile_now(StructuredOutputsParams(choice=["yes", "no"]))
    rng = random.Random(0)
    states = []
    for index in range(2 * MIN_BATCH_ROWS + 1):
        state = manager.new_state(schema if index % 3 else choice)
        for _ in range(rng.randrange(12)):
            allowed = [t for t in allowed_tokens(state) if t != EOS]
            if not allowed:
                break
            assert state.accept(rng.choice(allowed))
        states.append(state)
    width = states[0].bitmask_width
    for count in (MIN_BATCH_ROWS - 1, len(states)):
        alone = torch.zeros((count, width), dtype=torch.int32)
        for row, state in enumerate(states[:count]):
            state.fill_bitmask(alone, row)
        batched = torch.full((count, width), -1, dtype=torch.int32)
        fill_bitmasks(states[:count], batched)
        assert torch.equal(batched, alone)
    assert len({tuple(allowed_tokens(s)) for s in states}) > 2  # the rows differ: a mixed-up row would show


def test_valid_prefix_of_drafts_leaves_the_state(manager: StructuredOutputManager) -> None:
    tokenizer = smollm2_tokenizer()
    compiled = manager.compile_now(StructuredOutputsParams(regex=r"[0-9]{2}-[a-z]{2}"))
    state = manager.new_state(compiled)
    good = tokenizer.encode("12-ab", add_special_tokens=False)
    bad = tokenizer.encode("12x", add_special_tokens=False)
    assert state.valid_prefix_len(good + [EOS]) == len(good) + 1
    assert state.valid_prefix_len(good + [EOS, EOS]) == len(good) + 1  # nothing after the end
    assert state.valid_prefix_len(bad) == len(tokenizer.encode("12", add_special_tokens=False))
    assert state.num_accepted == 0 and allowed_tokens(state) == allowed_tokens(manager.new_state(compiled))


def test_choice_terminates_on_eos(manager: StructuredOutputManager) -> None:
    tokenizer = smollm2_tokenizer()
    state = manager.new_state(manager.compile_now(StructuredOutputsParams(choice=["yes", "no"])))
    for token in tokenizer.encode("yes", add_special_tokens=False):
        assert state.accept(token)
    assert allowed_tokens(state) == [EOS] and not state.is_terminated
    assert state.accept(EOS) and state.is_terminated


# ---- the sampler -------------------------------------------------------------------------------------
def test_sampler_masks_constrained_rows_only(manager: StructuredOutputManager) -> None:
    tokenizer = smollm2_tokenizer()
    state = manager.new_state(manager.compile_now(StructuredOutputsParams(choice=["yes", "no"])))
    allowed = allowed_tokens(state)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0)
    rows = [
        SamplingRow(greedy, [1], []),
        SamplingRow(greedy, [1], [], grammar=state),
        SamplingRow(greedy, [1], []),
    ]
    assert rows[1].needs_token_history and not rows[0].needs_token_history
    sampled = Sampler()(logits, rows).sampled_token_ids
    assert sampled[0] == int(logits[0].argmax()) and sampled[2] == int(logits[2].argmax())
    expected = max(allowed, key=lambda t: float(logits[1, t]))
    assert sampled[1] == expected and tokenizer.decode([expected]) in ("yes", "no", "y", "n", "ye")
    # random sampling (top_k, a seed) stays inside the mask too
    random_params = SamplingParams(temperature=1.5, top_k=50, seed=3)
    generator = torch.Generator().manual_seed(3)
    for _ in range(20):
        row = SamplingRow(random_params, [1], [], generator=generator, grammar=state)
        assert Sampler()(torch.randn(1, VOCAB), [row]).sampled_token_ids[0] in allowed


def test_unconstrained_batch_does_not_copy_the_logits() -> None:
    logits = torch.randn(2, 64)
    rows = [SamplingRow(SamplingParams(temperature=0), [1], []) for _ in range(2)]
    assert not any(row.needs_token_history for row in rows)
    assert Sampler()(logits, rows).sampled_token_ids == logits.argmax(dim=-1).tolist()


# ---- the engine-side manager --------------------------------------------------------------------------
def make_children(n: int) -> list[Request]:
    params = SamplingParams(n=n, structured_outputs={"choice": ["yes", "no"]})
    return [Request(f"r#{i}", "r", i, [1, 2], params, frozenset({EOS})) for i in range(n)]


def test_held_requests_get_one_state_each_and_stop(manager: StructuredOutputManager) -> None:
    tokenizer = smollm2_tokenizer()
    children = make_children(2)
    future = manager.submit(children[0].params.structured_outputs)
    manager.hold("r", children, future)
    assert manager.has_held
    future.result(timeout=60)
    ready = manager.take_ready()
    assert [(parent, error) for parent, _, error in ready] == [("r", None)] and not manager.has_held
    assert children[0].grammar is not None and children[0].grammar is not children[1].grammar
    yes = tokenizer.encode("yes", add_special_tokens=False)
    for token in yes:
        children[0].append_output_token(token)
        assert manager.advance([children[0]]) == ([], [])
    children[0].append_output_token(EOS)
    terminated, rejected = manager.advance([children[0]])
    assert terminated == [children[0]] and rejected == []
    children[1].append_output_token(tokenizer.encode("maybe", add_special_tokens=False)[0])
    terminated, rejected = manager.advance([children[1]])
    assert terminated == [] and len(rejected) == 1
    assert "grammar refused token" in rejected[0].message


def test_a_dropped_request_is_forgotten(manager: StructuredOutputManager) -> None:
    children = make_children(1)
    manager.hold("gone", children, manager.submit(children[0].params.structured_outputs))
    assert manager.drop("gone") and not manager.drop("gone")


# ---- tools ---------------------------------------------------------------------------------------------
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "ping"}},
]


def test_tool_schemas() -> None:
    schema = required_tools_schema(TOOLS)
    jsonschema.validate([{"name": "get_weather", "parameters": {"name": "x", "age": 3}}], schema)
    jsonschema.validate(
        [{"name": "ping", "parameters": {}}, {"name": "ping", "parameters": {"a": 1}}], schema
    )
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {"name": "x"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(
            [{"name": "ping", "parameters": {}}] * 2, required_tools_schema(TOOLS, parallel=False)
        )
    validate(StructuredOutputsParams(json=schema))
    assert named_tool_schema(TOOLS, "get_weather") == SCHEMA
    assert named_tool_schema(TOOLS, "ping") == {"type": "object"}
    with pytest.raises(
        ValueError, match="'nope', which is not in tools \\(offered: 'get_weather', 'ping'\\)"
    ):
        named_tool_schema(TOOLS, "nope")


def feed_in_pieces(parser, text: str) -> list:
    deltas = []
    rng = random.Random(0)
    position = 0
    while position < len(text):
        step = rng.randint(1, 5)
        deltas.append(parser.feed(text[position : position + step], position + step >= len(text)))
        position += step
    return deltas


def test_required_parser_streams_the_same_calls_it_parses() -> None:
    text = (
        '[{"name": "get_weather", "parameters": {"name": "Oslo", "age": 3}},\n'
        ' {"name": "ping", "parameters": {}}]'
    )
    parsed = RequiredToolsParser(TOOLS).parse(text)
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"name": "Oslo", "age": 3}),
        ("ping", {}),
    ]
    streamed = [
        call for delta in feed_in_pieces(RequiredToolsParser(TOOLS), text) for call in delta.tool_calls
    ]
    assert [(c.index, c.name, json.loads(c.arguments)) for c in streamed] == [
        (0, "get_weather", {"name": "Oslo", "age": 3}),
        (1, "ping", {}),
    ]
    assert all(c.id for c in streamed)
    # cut by max_tokens: the complete calls stay, the rest is dropped; nothing complete: content
    assert [c.name for c in RequiredToolsParser(TOOLS).parse(text[:-20]).tool_calls] == ["get_weather"]
    assert RequiredToolsParser(TOOLS).parse('[{"name": "ge').content == '[{"name": "ge'


def test_named_parser_streams_arguments() -> None:
    text = '{"name": "Oslo", "age": 3}'
    deltas = feed_in_pieces(NamedToolParser(TOOLS, "get_weather"), text)
    calls = [call for delta in deltas for call in delta.tool_calls]
    assert calls[0].name == "get_weather" and calls[0].id and all(c.name is None for c in calls[1:])
    assert {c.index for c in calls} == {0}
    assert json.loads("".join(c.arguments for c in calls)) == {"name": "Oslo", "age": 3}
    (call,) = NamedToolParser(TOOLS, "get_weather").parse(text).tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"name": "Oslo", "age": 3}
    assert NamedToolParser(TOOLS, "get_weather").parse('{"name": "Os').tool_calls == []
