"""IncrementalDetokenizer against the real SmolLM2 tokenizer (byte-level BPE) and a small
sentencepiece-style tokenizer (Metaspace + byte fallback) built with the `tokenizers` library."""

from __future__ import annotations

import gc
import itertools
import random
import weakref
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from fitserve.core.sampling_params import SamplingParams
from fitserve.engine.detokenizer import (
    MAX_PENDING_TOKENS,
    PROMPT_CONTEXT_TOKENS,
    IncrementalDetokenizer,
    decode_token,
)
from fitserve.token_bytes import CLEANUP_PROBE_TEXT, decode_with_table, token_byte_table
from tests.paths import SMOLLM2_TOKENIZER_DIR

SMOLLM2 = str(SMOLLM2_TOKENIZER_DIR)
IM_END = 2

MULTILINGUAL = (
    "你好，世界！今天天气很好。🎉👍🏽 家族 👨‍👩‍👧‍👦 naïve café — «ok» 日本語のテキスト、한국어 텍스트, "
    "Ελληνικά, עברית, 🇯🇵🇫🇷 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝄞 done."
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(SMOLLM2)


@pytest.fixture(scope="module")
def sp_tokenizer() -> Any:
    """Sentencepiece-style: '▁' marks a word start and the decoder drops the leading space of a decode;
    bytes of unknown characters are <0xNN> tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁Hello": 3, "▁world": 4, "!": 5, "▁": 6, "▁again": 7}
    vocab.update({f"<0x{b:02X}>": 8 + b for b in range(256)})
    model = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    model.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    model.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return PreTrainedTokenizerFast(
        tokenizer_object=model, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def feed_one_by_one(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str | None]:
    """Feeds tokens one at a time; returns the text each token added and the stop string, if any."""
    deltas = []
    stop = None
    for token_id in ids:
        before = detok.output_text
        stop = detok.add_tokens([token_id])
        assert detok.output_text.startswith(before) or stop is not None
        deltas.append(detok.output_text[len(before) :])
        if stop is not None:
            break
    return deltas, stop


@pytest.mark.parametrize(
    ("text", "has_split_characters"),
    [
        (MULTILINGUAL, True),
        ("🎉🎉🎉👍🏽👍🏽中文中文", True),
        ("Hello, world! This is a plain ASCII sentence,\n  with   spaces\tand tabs.", False),
    ],
    ids=["multilingual", "emoji-runs", "ascii"],
)
def test_streamed_text_equals_full_decode_and_deltas_are_valid(
    tokenizer: Any, text: str, has_split_characters: bool
) -> None:
    ids = tokenizer.encode(text)
    prompt = tokenizer.encode("Translate this:")
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    deltas, stop = feed_one_by_one(detok, ids)
    assert stop is None
    assert detok.output_text == tokenizer.decode(ids) == text
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)
    # Byte-level BPE splits these characters across tokens: some tokens had to add no text.
    assert (deltas.count("") > 0) is has_split_characters


def test_cost_per_token_is_bounded_by_the_window(tokenizer: Any) -> None:
    """The decoded windows stay short however long the output grows."""
    lengths: list[int] = []

    class RecordingTokenizer:
        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            lengths.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tokenizer.encode(MULTILINGUAL * 8)
    detok = IncrementalDetokenizer(
        RecordingTokenizer(), tokenizer.encode("a long prompt " * 50), SamplingParams()
    )
    detok.add_tokens(ids)
    assert detok.output_text == MULTILINGUAL * 8
    assert len(ids) > 400
    assert max(lengths) <= PROMPT_CONTEXT_TOKENS + MAX_PENDING_TOKENS


def test_adding_several_tokens_at_once_gives_the_same_text(tokenizer: Any) -> None:
    ids = tokenizer.encode(MULTILINGUAL)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    for start in range(0, len(ids), 3):
        detok.add_tokens(ids[start : start + 3])
    assert detok.output_text == MULTILINGUAL


def assert_stop_spans_tokens(tokenizer: Any, text: str, stop: str) -> None:
    """The stop string lies in no single token of `text`, so matching it needs several tokens."""
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode(text)]
    assert not any(stop in piece for piece in pieces)


def test_stop_string_split_across_tokens(tokenizer: Any) -> None:
    text = "The answer is forty-two, said the computer. More text follows."
    stop = "forty-two"
    assert_stop_spans_tokens(tokenizer, text, stop)
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["nothing", stop]))
    deltas, matched = feed_one_by_one(detok, ids)
    assert matched == stop
    assert detok.output_text == "The answer is "
    assert detok.stop_reason == stop
    # It stopped at the token that completed the stop string, not later.
    assert stop in tokenizer.decode(ids[: len(deltas)])
    assert stop not in tokenizer.decode(ids[: len(deltas) - 1])


def test_include_stop_str_in_output(tokenizer: Any) -> None:
    text = "Step one. Step two. END of story and more."
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(
        tokenizer, [1], SamplingParams(stop=["END of"], include_stop_str_in_output=True)
    )
    _, matched = feed_one_by_one(detok, ids)
    assert matched == "END of"
    assert detok.output_text == "Step one. Step two. END of"


def test_text_after_the_stop_in_the_same_token_is_cut(tokenizer: Any) -> None:
    ids = tokenizer.encode("alpha beta gamma delta")
    detok = IncrementalDetokenizer(
        tokenizer, [], SamplingParams(stop=["et"], include_stop_str_in_output=True)
    )
    assert detok.add_tokens(ids) == "et"
    assert detok.output_text == "alpha bet"


def test_first_stop_in_text_order_wins(tokenizer: Any) -> None:
    text = "one two three four"
    ids = tokenizer.encode(text)
    params = SamplingParams(stop=["four", "three", "two three"])
    detok = IncrementalDetokenizer(tokenizer, [], params)
    assert detok.add_tokens(ids) == "two three"  # ends first among the three, at the same place as "three"
    assert detok.output_text == "one "
    detok = IncrementalDetokenizer(tokenizer, [], params)
    assert feed_one_by_one(detok, ids)[1] == "two three"


def test_stream_text_holds_back_a_possible_stop_prefix(tokenizer: Any) -> None:
    text = "Counting: 1 2 3 4 5 6 7 STOP-NOW 8 9"
    stop = "STOP-NOW"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[stop]))
    shown: list[str] = []
    matched = None
    for token_id in ids:
        matched = detok.add_tokens([token_id])
        visible = detok.stream_text(finished=matched is not None)
        if shown:
            assert visible.startswith(shown[-1])  # only grows
        if matched is None:
            assert len(visible) == max(0, len(detok.output_text) - (len(stop) - 1))
            assert "S" not in visible  # never shows the start of the stop string early
        shown.append(visible)
        if matched is not None:
            break
    assert matched == stop
    assert shown[-1] == "Counting: 1 2 3 4 5 6 7 "


def test_stream_text_without_stop_strings_shows_everything(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    detok.add_tokens(tokenizer.encode("no stops here"))
    assert detok.stream_text(finished=False) == "no stops here"


def test_adding_tokens_after_a_stop_is_refused(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["b"]))
    assert detok.add_tokens(tokenizer.encode("a b c")) == "b"
    with pytest.raises(RuntimeError, match="after the stop string 'b'"):
        detok.add_tokens([42])


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer: Any, skip: bool) -> None:
    ids = tokenizer.encode("Hi there") + [IM_END] + tokenizer.encode("\nnext 你好") + [1, IM_END]
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(skip_special_tokens=skip))
    deltas, _ = feed_one_by_one(detok, ids)
    expected = tokenizer.decode(ids, skip_special_tokens=skip)
    assert detok.output_text == expected
    assert ("<|im_end|>" in expected) is not skip
    assert all("\ufffd" not in d for d in deltas)


def test_detokenize_false_produces_no_text(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(detokenize=False))
    assert detok.add_tokens(tokenizer.encode("hello")) is None
    assert detok.output_text == ""


def test_decode_token(tokenizer: Any) -> None:
    hello = tokenizer.encode(" hello")
    assert decode_token(tokenizer, hello[0]) == " hello"
    assert decode_token(tokenizer, IM_END) == "<|im_end|>"
    assert decode_token(tokenizer, tokenizer.encode("你")[0]) == "\ufffd"  # a partial character


# ---- sentencepiece-style tokenizer ----------------------------------------------------------------


def test_sentencepiece_leading_spaces_use_the_prompt_context(sp_tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(sp_tokenizer, [1, 3], SamplingParams())  # prompt "<s>▁Hello"
    deltas, _ = feed_one_by_one(detok, [4, 5, 7])
    assert deltas == [" world", "!", " again"]
    assert sp_tokenizer.decode([1, 3, 4, 5, 7], skip_special_tokens=True) == "Hello" + "".join(deltas)


def test_sentencepiece_byte_fallback_characters(sp_tokenizer: Any) -> None:
    byte_ids = [8 + b for b in "你🎉".encode()]
    ids = [3, 6, *byte_ids, 7]  # "▁Hello ▁ <bytes...> ▁again"
    detok = IncrementalDetokenizer(sp_tokenizer, [], SamplingParams())
    deltas, _ = feed_one_by_one(detok, ids)
    assert detok.output_text == sp_tokenizer.decode(ids) == "Hello 你🎉 again"
    assert all("\ufffd" not in d for d in deltas)


def test_spaces_between_special_tokens(sp_tokenizer: Any) -> None:
    ids = [3, 1, 4, 2, 5]  # ▁Hello <s> ▁world </s> !
    spaced = IncrementalDetokenizer(sp_tokenizer, [], SamplingParams(skip_special_tokens=False))
    spaced.add_tokens(ids)
    assert spaced.output_text == sp_tokenizer.decode(ids) == "Hello<s> world</s>!"
    tight = IncrementalDetokenizer(
        sp_tokenizer, [], SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    )
    feed_one_by_one(tight, ids)
    assert tight.output_text == "Hello<s>world</s>!"


def test_invalid_bytes_are_flushed_after_a_bounded_wait(sp_tokenizer: Any) -> None:
    stray_continuation_bytes = [8 + 0x80] * (MAX_PENDING_TOKENS + 2)
    detok = IncrementalDetokenizer(sp_tokenizer, [3], SamplingParams())
    detok.add_tokens([*stray_continuation_bytes, 4])
    assert detok.output_text.endswith(" world")
    assert detok.output_text.count("\ufffd") == MAX_PENDING_TOKENS + 2


# ---- fast path: token byte tables (fitserve/token_bytes.py) -------------------------------
# ASCII, Latin, Greek, Cyrillic, Arabic, Indic, Thai, kana, CJK, Hangul, emoji, math, CJK extension B.
SCRIPTS = [(32, 126), (0xA0, 0x6FF), (0x900, 0xE7F), (0x3040, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x2A6DF)]


def random_text(rng: random.Random, length: int) -> str:
    return "".join(chr(rng.randint(*rng.choice(SCRIPTS))) for _ in range(length))


def streamed(tokenizer: Any, prompt: list[int], ids: list[int], rng: random.Random, **params: Any) -> str:
    """The fast path's final text, tokens fed in chunks of 1, 2 or 3; checks the text only grows."""
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(**params))
    assert detok.uses_byte_table
    for start, end in itertools.pairwise([*range(0, len(ids), rng.randint(1, 3)), len(ids)]):
        before = detok.output_text
        detok.add_tokens(ids[start:end])
        assert detok.output_text.startswith(before)
    detok.finish()
    return detok.output_text


def test_byte_table_and_decode_token_equal_decode_on_the_vocabulary(tokenizer: Any) -> None:
    table = token_byte_table(tokenizer)
    assert table is not None and token_byte_table(tokenizer) is table  # built once per tokenizer
    ids = [*range(len(tokenizer) + 100)]  # ids past the vocabulary decode to nothing
    for skip in (False, True):
        assert decode_with_table(table, ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)
    with pytest.raises(ValueError, match="token id -3 is negative: token ids are 0 or more"):
        IncrementalDetokenizer(tokenizer, [], SamplingParams()).add_tokens([5, -3])
    sample = [*range(0, len(ids), 11), *range(17)]
    assert [decode_token(tokenizer, i) for i in sample] == [tokenizer.decode([i]) for i in sample]


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_stream_to_exactly_decode(tokenizer: Any, skip: bool) -> None:
    """Random ids (partial and invalid UTF-8, specials, unknown ids): decode's text, U+FFFD included."""
    rng = random.Random(int(skip))
    pools = [range(len(tokenizer)), range(17), range(len(tokenizer), len(tokenizer) + 64)]
    for _ in range(3):
        ids = [rng.choice(rng.choices(pools, weights=[85, 10, 5])[0]) for _ in range(3000)]
        expected = tokenizer.decode(ids, skip_special_tokens=skip)
        assert streamed(tokenizer, [], ids, rng, skip_special_tokens=skip) == expected


@pytest.mark.parametrize("skip", [True, False])
def test_text_in_many_scripts_with_special_tokens(tokenizer: Any, skip: bool) -> None:
    rng = random.Random(7)
    for text in (MULTILINGUAL * 3, random_text(rng, 3000)):
        ids = tokenizer.encode(text)
        deltas, _ = feed_one_by_one(IncrementalDetokenizer(tokenizer, [], SamplingParams()), ids)
        assert "".join(deltas) == text and all("\ufffd" not in delta for delta in deltas)
        for _ in range(30):
            ids.insert(rng.randrange(len(ids)), rng.randrange(17))
        expected = tokenizer.decode(ids, skip_special_tokens=skip)
        assert streamed(tokenizer, [1, 2], ids, rng, skip_special_tokens=skip) == expected
        params = SamplingParams(skip_special_tokens=skip)
        window = IncrementalDetokenizer(tokenizer, [1, 2], params, use_byte_table=False)
        assert window.add_tokens(ids) is None and window.output_text == expected


def sentencepiece_ids(rng: random.Random, pieces: int) -> list[int]:
    """Words, special tokens, valid characters as <0xNN> tokens, and invalid byte runs between words."""
    invalid_runs = [[0x80], [0xE4, 0xBD], [0xF0, 0x9F, 0x8E], [0xFF], [0xC0, 0x80], [0xED, 0xA0, 0x80]]
    choices = [
        lambda: [rng.choice([0, 3, 4, 5, 6, 7])],
        lambda: [rng.choice([1, 2])],
        lambda: [8 + b for b in random_text(rng, rng.randint(1, 3)).encode()],
        lambda: [4, *(8 + b for b in rng.choice(invalid_runs)), 5],
    ]
    return [token for _ in range(pieces) for token in rng.choice(choices)()]


@pytest.mark.parametrize("skip", [True, False])
def test_sentencepiece_random_sequences_stream_to_decode(sp_tokenizer: Any, skip: bool) -> None:
    """The leading-space strip applies only where the whole text (prompt context included) starts."""
    rng = random.Random(3)
    for prompt in ([], [1], [2, 1], [6], [1, 3], [5, 5, 5, 5, 5, 6]):
        ids, context = sentencepiece_ids(rng, 400), prompt[-PROMPT_CONTEXT_TOKENS:]
        full = sp_tokenizer.decode(context + ids, skip_special_tokens=skip)
        prefix = sp_tokenizer.decode(context, skip_special_tokens=skip)
        assert full.startswith(prefix)
        assert streamed(sp_tokenizer, prompt, ids, rng, skip_special_tokens=skip) == full[len(prefix) :]
    all_ids = range(270)
    assert [decode_token(sp_tokenizer, i) for i in all_ids] == [sp_tokenizer.decode([i]) for i in all_ids]
    # The documented difference: decode turns a whole byte-fallback run with an invalid byte into
    # U+FFFDs; the stream already showed the valid character and replaces only the invalid byte.
    ids = [3, *(8 + b for b in "你".encode()), 8 + 0x80, 4]
    assert sp_tokenizer.decode(ids) == "Hello" + "\ufffd" * 4 + " world"
    assert streamed(sp_tokenizer, [], ids, rng) == "Hello你\ufffd world"


def word_level(words: list[str], decoder: Any = None, **kwargs: Any) -> Any:
    """A sentencepiece-style word tokenizer (Replace, Fuse, Strip decoder unless `decoder` is given)."""
    model = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "<s>", "!", *words])}, "<unk>"))
    steps = [decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    model.pre_tokenizer, model.decoder = pre_tokenizers.Metaspace(), decoder or decoders.Sequence(steps)
    model.add_special_tokens([AddedToken("<s>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", bos_token="<s>", **kwargs)


def test_which_tokenizers_get_a_byte_table(tokenizer: Any, sp_tokenizer: Any) -> None:
    words = ["▁" + w for w in CLEANUP_PROBE_TEXT.split()]
    cleaned = word_level(words, clean_up_tokenization_spaces=True)
    assert cleaned.decode(cleaned.encode("a , b")) == "a, b"  # clean-up changes the text

    class OwnDecode(type(tokenizer)):  # type: ignore[misc]
        def _decode(self, token_ids: Any, **kwargs: Any) -> str:
            return super()._decode(token_ids, **kwargs).upper()

    ineligible = [cleaned, word_level(words, decoders.WordPiece()), word_level(words, decoders.Metaspace())]
    assert [token_byte_table(tok) for tok in [*ineligible, OwnDecode.from_pretrained(SMOLLM2)]] == [None] * 4
    params = SamplingParams(spaces_between_special_tokens=False)
    assert not IncrementalDetokenizer(sp_tokenizer, [], params).uses_byte_table
    old = token_byte_table(eligible := word_level(words))  # no clean-up: a table
    eligible.add_tokens(["<new>"])  # a tokenizer that gains tokens gets a new table
    table = weakref.ref(token_byte_table(eligible))
    assert table() is not old and decode_with_table(table(), [len(eligible) - 1], True) == "<new>"
    del eligible, old
    gc.collect()
    assert table() is None  # freed with its tokenizer


def test_finish_ends_an_unfinished_character_like_decode(tokenizer: Any) -> None:
    ids = tokenizer.encode("ok, 🎉")[:-1]  # the emoji's last byte is missing
    for use_byte_table in (True, False):
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(), use_byte_table=use_byte_table)
        assert detok.add_tokens(ids) is None and "\ufffd" not in detok.output_text
        assert detok.finish() is None and detok.output_text == tokenizer.decode(ids) == "ok, \ufffd"
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["\ufffd"]))
    assert detok.add_tokens(ids) is None and detok.finish() == "\ufffd" and detok.output_text == "ok, "
