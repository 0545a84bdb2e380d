"""The fewest tokens a grammar's complete output can take (fitserve/structured/min_tokens.py), and the 400 /
ValueError for a request whose max_tokens cannot hold one: the shortest-output analysis against known
answers and a brute-force search with xgrammar's own matcher, the token bound against real outputs'
tokenizations (the tokenizer's and the shortest possible one), and the server and the engine's manager
refusing before any decoding while the bound itself is accepted."""

from __future__ import annotations

import json
import threading
import time

import pytest
import xgrammar as xgr

from fitserve import LLM, SamplingParams
from fitserve.structured import StructuredOutputsParams
from fitserve.structured import min_tokens as mt
from fitserve.structured.backend import build_grammar, validate
from fitserve.structured.manager import StructuredOutputManager
from fitserve.token_bytes import token_byte_table
from tests.model_folders import save_with_tokenizer
from tests.unit.model_helpers import build_hf_model, tiny_hf_config
from tests.unit.server_helpers import build_test_client, smollm2_tokenizer

VOCAB = 49152
EOS = 2
KEY = "sk-test"
HEADERS = {"Authorization": f"Bearer {KEY}"}
FIELDS = [f"field_{i}" for i in range(12)]
# 12 required strings: the shortest output is {"field_0":"",...,"field_11":""}, 159 bytes
MANY_FIELDS = {
    "type": "object",
    "properties": {name: {"type": "string"} for name in FIELDS},
    "required": FIELDS,
    "additionalProperties": False,
}


def shortest_bytes(grammar: str) -> float:
    rules = mt.read_ebnf(str(xgr.Grammar.from_ebnf(grammar)))
    return mt.cheapest(rules, mt.ByteCosts.bytes())


def bound(params: StructuredOutputsParams) -> mt.OutputBound:
    result = mt.output_bound(params.to_spec(), smollm2_tokenizer())
    assert result is not None
    return result


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    info = xgr.TokenizerInfo.from_huggingface(smollm2_tokenizer(), vocab_size=VOCAB, stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info)


def accepts(compiler: xgr.GrammarCompiler, params: StructuredOutputsParams, text: str) -> bool:
    """xgrammar's matcher takes the whole text and may end there: a complete valid output."""
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(build_grammar(params.to_spec())))
    return bool(matcher.accept_string(text)) and bool(matcher.is_completed())


def fewest_tokens(text: str) -> int:
    """The shortest tokenization of text over the whole vocabulary (not the tokenizer's own encoding)."""
    vocabulary = set(token_byte_table(smollm2_tokenizer()).bytes_by_id)
    data = text.encode()
    best = [0] + [len(data) + 1] * len(data)
    for end in range(1, len(data) + 1):
        for size in range(1, min(end, 128) + 1):
            if best[end - size] + 1 < best[end] and data[end - size : end] in vocabulary:
                best[end] = best[end - size] + 1
    return best[-1]


# ---- the shortest output, in bytes ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("grammar", "expected"),
    [
        ('root ::= "hello"', 5),
        ('root ::= "abc" | "de" | "fghi"', 2),
        ('root ::= "ab"{3,5} "c"+ "d"* "e"?', 7),
        ('root ::= a b\na ::= "x" c\nb ::= "yy"\nc ::= "zzz" | ""', 3),
        ('root ::= "(" root ")" | "(" ")"', 2),  # recursion: the base case
        ('root ::= "[" (root ("," root)*)? "]" | [0-9]+', 1),
        ('root ::= [a-z]{4} "\\n" [^abc]', 6),
        ('root ::= "€😀"', 7),  # UTF-8 bytes, not characters
        ('root ::= "é"', 1),  # printed "\xe9": a code point (2 bytes) or one raw byte, the lower read
        ('root ::= [α-ω] "x"', 3),
        ('root ::= "" | "abc"', 0),
    ],
)
def test_shortest_output_of_small_grammars(grammar: str, expected: int) -> None:
    assert shortest_bytes(grammar) == expected


def test_a_grammar_without_a_finite_output_costs_infinity() -> None:
    assert shortest_bytes('root ::= "a" root') == mt.INF
    spec = StructuredOutputsParams(grammar='root ::= "a" root')
    with pytest.raises(ValueError, match="the grammar has no finite output, so no max_tokens can hold one"):
        validate(spec, max_tokens=4096, tokenizer=smollm2_tokenizer())


def test_json_values_recurse_to_a_finite_minimum() -> None:
    assert bound(StructuredOutputsParams(json_object=True)).min_bytes == 2  # {}
    assert (
        bound(StructuredOutputsParams(json={"type": "array", "items": {}, "minItems": 3})).min_bytes == 7
    )  # [0,0,0]
    assert bound(StructuredOutputsParams(json=MANY_FIELDS)).min_bytes == 159
    compact = StructuredOutputsParams(json=MANY_FIELDS, disable_any_whitespace=True)  # ", " and ": "
    assert bound(compact).min_bytes == 159 + 11 + 12


def brute_force_shortest(compiler: xgr.GrammarCompiler, grammar: str, alphabet: str, limit: int) -> int:
    """The length of the shortest string over alphabet that xgrammar's matcher completes on (breadth
    first, extending only the prefixes it accepts)."""
    start = xgr.GrammarMatcher(compiler.compile_grammar(xgr.Grammar.from_ebnf(grammar)))
    frontier = [start]
    for length in range(limit + 1):
        if any(matcher.is_completed() for matcher in frontier):
            return length
        grown = []
        for matcher in frontier:
            for char in alphabet:
                child = matcher.fork()
                if child.accept_string(char):
                    grown.append(child)
        frontier = grown
    raise AssertionError(f"no string of at most {limit} characters completes {grammar!r}")


@pytest.mark.parametrize(
    ("grammar", "alphabet"),
    [
        ('root ::= ("ab" | "c"){2,3} x\nx ::= "d" | "ee" x', "abcde"),
        ('root ::= "[" items? "]"\nitems ::= v ("," v)*\nv ::= "1" | root', "[],1"),
        ('root ::= a{2} | b\na ::= "xy" | "z"\nb ::= "wwwww"', "xyzw"),
        ('root ::= [a-c]+ "-" [0-9]{2,}', "ab-19"),
    ],
)
def test_shortest_output_equals_a_brute_force_search(compiler, grammar: str, alphabet: str) -> None:
    assert shortest_bytes(grammar) == brute_force_shortest(compiler, grammar, alphabet, limit=8)


# ---- the token bound -----------------------------------------------------------------------------------
NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "size": {"enum": ["small", "medium", "large"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "[0-9]{5}"}},
            "required": ["city", "zip"],
        },
        "score": {"type": "number"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "size", "tags", "home", "score", "ok"],
    "additionalProperties": False,
}
NESTED_VALUES = [
    {"name": "", "age": 0, "size": "small", "tags": ["", ""], "home": {"city": "", "zip": "00000"},
     "score": 0, "ok": True},
    {"name": "Ada Byron", "age": 36, "size": "medium", "tags": ["math", "engines", "poetry"],
     "home": {"city": "London", "zip": "12345"}, "score": 9.75, "ok": False},
]  # fmt: skip


@pytest.mark.parametrize(
    ("params", "texts"),
    [
        (
            StructuredOutputsParams(json=MANY_FIELDS),
            [json.dumps(dict.fromkeys(FIELDS, ""), separators=(",", ":"))]
            + [json.dumps({name: f"value {i}" for i, name in enumerate(FIELDS)}, indent=2)],
        ),
        (
            StructuredOutputsParams(json=NESTED),
            [json.dumps(value, separators=(",", ":")) for value in NESTED_VALUES]
            + [json.dumps(value) for value in NESTED_VALUES],
        ),
        (
            StructuredOutputsParams(json=NESTED, disable_any_whitespace=True),
            [json.dumps(value, separators=(", ", ": ")) for value in NESTED_VALUES],
        ),
        (StructuredOutputsParams(regex=r"\d{3}-\d{4}"), ["000-0000", "555-1234"]),
        (
            StructuredOutputsParams(regex=r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"),
            ["abc@de.com", "alice@mail.org"],
        ),
        (StructuredOutputsParams(choice=["yes", "no", "maybe so"]), ["no", "yes", "maybe so"]),
        (
            StructuredOutputsParams(grammar='root ::= "(" num ("+" num)* ")"\nnum ::= [0-9]+'),
            ["(1)", "(12+7)"],
        ),
    ],
    ids=["many-fields", "nested", "nested-compact", "phone", "email", "choice", "grammar"],
)
def test_no_valid_output_takes_fewer_tokens_than_the_bound(compiler, params, texts: list[str]) -> None:
    """Soundness: valid outputs (the shortest among them) tokenized by the tokenizer and by the shortest
    tokenization the vocabulary allows never take fewer tokens than the bound."""
    result = bound(params)
    assert result.min_tokens >= 1
    for text in texts:
        assert accepts(compiler, params, text), text  # the text really is a complete valid output
        assert len(text.encode()) >= result.min_bytes
        assert fewest_tokens(text) >= result.min_tokens, (text, result)
        assert len(smollm2_tokenizer().encode(text, add_special_tokens=False)) >= result.min_tokens


def test_the_bound_is_useful_not_just_bytes_over_the_longest_token() -> None:
    """SmolLM2's longest token is 81 bytes of spaces: bytes / 81 would allow 2 tokens for 159 bytes;
    quotes, braces and colons are in no token longer than 5 bytes, digits are tokens of their own."""
    many = bound(StructuredOutputsParams(json=MANY_FIELDS))
    assert many.longest_token == 81 and many.min_tokens >= 25
    assert bound(StructuredOutputsParams(regex=r"\d{3}-\d{4}")).min_tokens == 8
    # a schema's string pattern (xgrammar prints it as a Regex element): 5 digits and the quotes
    pattern = bound(StructuredOutputsParams(json={"type": "string", "pattern": "[0-9]{5}"}))
    assert (pattern.min_bytes, pattern.min_tokens) == (7, 6)


def test_refused_below_the_bound_and_accepted_at_it() -> None:
    tokenizer = smollm2_tokenizer()
    params = StructuredOutputsParams(json=MANY_FIELDS)
    needed = int(bound(params).min_tokens)
    validate(params, max_tokens=needed, tokenizer=tokenizer)  # at the bound: not refused
    with pytest.raises(ValueError) as raised:
        validate(params, max_tokens=5, tokenizer=tokenizer)
    message = str(raised.value)
    assert message.startswith(f"max_tokens is 5, but the JSON schema needs at least {needed} tokens")
    assert "its shortest valid output is 159 bytes" in message
    assert f"raise max_tokens to at least {needed}" in message and "fewer required properties" in message
    with pytest.raises(ValueError, match="the choice needs at least 4 tokens.*or offer a shorter choice"):
        validate(
            StructuredOutputsParams(choice=["1234", "56789"]), max_tokens=3, tokenizer=tokenizer
        )  # digits
    validate(StructuredOutputsParams(choice=["yes", "no"]), max_tokens=1, tokenizer=tokenizer)  # one word


def test_lark_grammars_and_tokenizers_without_a_byte_table_get_no_bound() -> None:
    lark = StructuredOutputsParams(grammar='start: "abcdefghij" "klmnopqrst"')
    assert mt.output_bound(lark.to_spec(), smollm2_tokenizer()) is None
    validate(lark, max_tokens=1, tokenizer=smollm2_tokenizer())  # not checked: never refused
    assert mt.output_bound(StructuredOutputsParams(regex="abc").to_spec(), object()) is None


def test_an_unknown_construct_gives_no_bound() -> None:
    with pytest.raises(mt.GrammarReadError):
        mt.read_ebnf('root ::= TagDispatch(("a", b))')
    with pytest.raises(mt.GrammarReadError):
        mt.read_ebnf("root ::= <123>")


def test_manager_refuses_before_compiling_and_caches_the_bound() -> None:
    manager = StructuredOutputManager(smollm2_tokenizer(), VOCAB, frozenset({EOS}), preload=False)
    try:
        params = StructuredOutputsParams(json=MANY_FIELDS)
        with pytest.raises(ValueError, match="max_tokens is 3, but the JSON schema needs at least"):
            manager.submit(params, max_tokens=3)
        assert manager.cache_misses == 0  # nothing was queued for compiling
        needed = int(bound(params).min_tokens)
        future = manager.submit(params, max_tokens=needed)
        assert future.result(timeout=60) is not None
        with pytest.raises(ValueError, match=f"to at least {needed}"):  # a cached spec is checked too
            manager.submit(params, max_tokens=needed - 1)
        room = {"limit": "max_model_len 64 leaves 4 tokens after the prompt's 60", "fix": "room for {needed}"}
        with pytest.raises(ValueError, match=f"^max_model_len 64 leaves 4 tokens.*: room for {needed}, or"):
            manager.submit(params, max_tokens=4, **room)
    finally:
        manager.shutdown()


# ---- the server ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served():
    reply = json.dumps(dict.fromkeys(FIELDS, "x"), separators=(",", ":"))
    test_client, engine = build_test_client(lambda prompt, index: reply, step_delay_s=0.002, api_key=KEY)
    with test_client:
        yield test_client, engine


def schema_request(path: str, **fields) -> dict:
    body = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    schema = {"type": "json_schema", "json_schema": {"name": "many", "schema": MANY_FIELDS}}
    return body | {"response_format": schema} | fields


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_server_answers_400_before_decoding(served, path: str, stream: bool) -> None:
    client, engine = served
    added = len(engine.added)
    response = client.post(path, json=schema_request(path, max_tokens=5, stream=stream), headers=HEADERS)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format" and error["code"] == 400
    assert error["message"].startswith("response_format: max_tokens is 5, but the JSON schema needs at least")
    assert len(engine.added) == added  # never reached the engine
    needed = int(bound(StructuredOutputsParams(json=MANY_FIELDS)).min_tokens)
    ok = client.post(path, json=schema_request(path, max_tokens=needed, stream=stream), headers=HEADERS)
    assert ok.status_code == 200, ok.text


def test_server_names_the_field_the_request_set(served) -> None:
    client, _ = served
    path = "/v1/chat/completions"
    body = schema_request(path, max_completion_tokens=4)
    error = client.post(path, json=body, headers=HEADERS).json()["error"]
    assert error["message"].startswith("response_format: max_completion_tokens is 4, but")
    assert "raise max_completion_tokens to at least" in error["message"]
    body = {"messages": [{"role": "user", "content": "hi"}], "guided_regex": r"\d{40}", "max_tokens": 9}
    error = client.post(path, json=body, headers=HEADERS).json()["error"]
    assert error["param"] == "guided_regex" and "the regex needs at least 40 tokens" in error["message"]


def test_a_refused_request_leaves_the_one_in_flight_alone(served) -> None:
    client, engine = served
    path = "/v1/chat/completions"
    results: dict[str, object] = {}

    def long_request() -> None:
        body = schema_request(path, max_tokens=200, stream=True)
        results["long"] = client.post(path, json=body, headers=HEADERS)

    thread = threading.Thread(target=long_request)
    thread.start()
    deadline = time.monotonic() + 30
    while not engine.requests and time.monotonic() < deadline:  # the long one is decoding
        time.sleep(0.001)
    refused = client.post(path, json=schema_request(path, max_tokens=2), headers=HEADERS)
    thread.join(timeout=60)
    assert refused.status_code == 400
    long = results["long"]
    assert long.status_code == 200
    chunks = [line for line in long.text.splitlines() if line.startswith("data: {")]
    text = "".join(
        choice["delta"].get("content") or "" for line in chunks for choice in json.loads(line[6:])["choices"]
    )
    assert json.loads(text) == dict.fromkeys(FIELDS, "x")
    assert long.text.rstrip().endswith("data: [DONE]")


# ---- offline: LLM.generate ---------------------------------------------------------------------------
def test_offline_generate_raises_before_anything_runs(tmp_path) -> None:
    config = tiny_hf_config("LlamaForCausalLM", vocab_size=VOCAB, eos_token_id=EOS)
    save_with_tokenizer(build_hf_model(config, seed=3), tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", num_gpu_blocks_override=64, block_size=8, max_model_len=64)
    constraint = StructuredOutputsParams(json=MANY_FIELDS)
    needed = int(bound(constraint).min_tokens)
    prompt = {"prompt_token_ids": [5, 17, 33, 90]}
    with pytest.raises(
        ValueError, match=f"^max_tokens is 5, but the JSON schema needs at least {needed} tokens"
    ):
        llm.generate([prompt], SamplingParams(max_tokens=5, structured_outputs=constraint), use_tqdm=False)
    long_prompt = {"prompt_token_ids": list(range(100, 100 + 64 - needed + 1))}  # leaves needed - 1
    with pytest.raises(ValueError, match=f"^max_model_len 64 leaves {needed - 1} tokens after the prompt's"):
        llm.generate(
            [long_prompt], SamplingParams(max_tokens=None, structured_outputs=constraint), use_tqdm=False
        )
    # the engine still serves: at the bound the request runs (a random model: any finish reason)
    params = SamplingParams(temperature=0, max_tokens=needed, structured_outputs=constraint)
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) <= needed
