"""bad_words through the sampler's masking path: the words as token ids (vLLM's rule), the ban of a
word's last token where the output ends with its other tokens, the exact history it needs, and the
server field."""

from __future__ import annotations

import pytest
import torch

from fitserve.core.sampling_params import SamplingParams
from fitserve.worker.logits_processors import ban_bad_words
from fitserve.worker.sampler import Sampler, SamplingRow
from tests.unit.server_helpers import build_test_client, smollm2_tokenizer


def params_with(words: list[str], **fields) -> SamplingParams:
    params = SamplingParams(bad_words=words, **fields)
    params.update_from_tokenizer(smollm2_tokenizer())
    return params


def test_words_become_token_sequences() -> None:
    tokenizer = smollm2_tokenizer()
    params = params_with(["hello", "unbelievable"])
    alone = tokenizer.encode("hello", add_special_tokens=False)
    spaced = tokenizer.encode(" hello", add_special_tokens=False)
    assert alone != spaced and len(alone) == len(spaced) == 1
    long_alone = tokenizer.encode("unbelievable", add_special_tokens=False)
    assert params.bad_words_token_ids[:2] == [alone, spaced]
    assert params.bad_words_token_ids[2] == long_alone and len(long_alone) > 1
    # " unbelievable" is fewer tokens than "unbelievable": left out, as vLLM does
    assert len(params.bad_words_token_ids) == 3


@pytest.mark.parametrize(("words", "message"), [([""], "every entry must be a word"), (3, "list of strings")])
def test_bad_values_are_refused(words, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(bad_words=words)


def test_last_token_banned_only_after_the_others() -> None:
    params = SamplingParams()
    params.bad_words_token_ids = [[7], [3, 4, 5]]
    logits = torch.zeros(3, 10)
    rows = [
        SamplingRow(params, [1], [9, 3, 4]),  # ends with 3, 4: 5 is banned, and 7 always
        SamplingRow(params, [1], [3, 9]),  # only 7
        SamplingRow(SamplingParams(), [1], [3, 4]),  # no bad words: untouched
    ]
    ban_bad_words(logits, rows)
    assert torch.isinf(logits[0]).nonzero().flatten().tolist() == [5, 7]
    assert torch.isinf(logits[1]).nonzero().flatten().tolist() == [7]
    assert not torch.isinf(logits[2]).any()
    assert rows[0].needs_token_history  # a word of several tokens reads the exact output
    single = SamplingParams()
    single.bad_words_token_ids = [[7]]
    assert not SamplingRow(single, [1], []).needs_token_history


def test_greedy_sampler_avoids_the_word() -> None:
    params = params_with(["hello"], temperature=0)
    banned = params.bad_words_token_ids[0][0]
    logits = torch.zeros(1, 49152)
    logits[0, banned] = 10.0
    logits[0, 17] = 5.0
    assert Sampler()(logits, [SamplingRow(params, [1], [])]).sampled_token_ids == [17]


def test_server_takes_bad_words_and_names_a_bad_one() -> None:
    client, engine = build_test_client(lambda prompt, index: "Paris.")
    with client:
        ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "bad_words": ["London"]})
        assert ok.status_code == 200
        bad = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "bad_words": [" "]})
        assert bad.status_code == 400
        error = bad.json()["error"]
        assert error["param"] == "bad_words" and "every entry must be a word" in error["message"]
