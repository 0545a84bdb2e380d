"""SamplingParams: vLLM's defaults, normalisation, and refusal of bad values with a message that names
the value, the limit and the fix."""

from __future__ import annotations

import dataclasses

import pytest

from fitserve.core.sampling_params import RequestOutputKind, SamplingParams, SamplingType


def test_defaults_are_vllms() -> None:
    params = SamplingParams()
    expected = {
        "n": 1,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "seed": None,
        "stop": [],
        "stop_token_ids": [],
        "ignore_eos": False,
        "max_tokens": 16,
        "min_tokens": 0,
        "logprobs": None,
        "prompt_logprobs": None,
        "detokenize": True,
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "include_stop_str_in_output": False,
        "logit_bias": None,
        "allowed_token_ids": None,
        "bad_words": None,
        "output_kind": RequestOutputKind.CUMULATIVE,
        "structured_outputs": None,
        "guided_decoding": None,
    }
    assert {f.name: getattr(params, f.name) for f in dataclasses.fields(params)} == expected
    assert params.sampling_type == SamplingType.RANDOM


# (keyword arguments, substrings the message must contain: the value, the limit, the fix)
BAD_VALUES = [
    ({"max_tokens": 0}, ["max_tokens=0", "minimum 1", "set max_tokens to 1 or more"]),
    ({"max_tokens": -5}, ["max_tokens=-5", "minimum 1", "set max_tokens to 1 or more"]),
    ({"temperature": -0.1}, ["temperature=-0.1", "minimum 0", "set temperature to 0"]),
    ({"temperature": float("nan")}, ["temperature=nan", "finite", "set temperature to a finite number"]),
    ({"top_p": 0.0}, ["top_p=0.0", "(0, 1]", "set top_p above 0 and at most 1"]),
    ({"top_p": 1.5}, ["top_p=1.5", "(0, 1]", "set top_p above 0 and at most 1"]),
    ({"top_k": -2}, ["top_k=-2", "minimum -1", "set top_k to 0 or -1 (off)"]),
    ({"top_k": 2.5}, ["top_k=2.5", "not an integer", "set top_k to a whole number"]),
    ({"min_p": -0.1}, ["min_p=-0.1", "[0, 1]", "set min_p between 0"]),
    ({"min_p": 1.1}, ["min_p=1.1", "[0, 1]", "set min_p between 0"]),
    ({"n": 0}, ["n=0", "minimum 1", "set n to 1 or more"]),
    ({"presence_penalty": 2.5}, ["presence_penalty=2.5", "[-2, 2]", "set presence_penalty between -2 and 2"]),
    ({"presence_penalty": -3}, ["presence_penalty=-3", "[-2, 2]", "set presence_penalty between -2 and 2"]),
    (
        {"frequency_penalty": -2.01},
        ["frequency_penalty=-2.01", "[-2, 2]", "set frequency_penalty between -2 and 2"],
    ),
    ({"repetition_penalty": 0.0}, ["repetition_penalty=0.0", "greater than 0", "set repetition_penalty"]),
    ({"repetition_penalty": -1.0}, ["repetition_penalty=-1.0", "greater than 0", "(1 = off"]),
    ({"min_tokens": -1}, ["min_tokens=-1", "minimum 0", "set min_tokens to 0 or more"]),
    (
        {"min_tokens": 20, "max_tokens": 10},
        ["min_tokens=20", "max_tokens=10", "set min_tokens to at most 10"],
    ),
    ({"logprobs": -1}, ["logprobs=-1", "minimum 0", "set logprobs to 0 or more"]),
    ({"prompt_logprobs": -3}, ["prompt_logprobs=-3", "minimum 0", "set prompt_logprobs to 0 or more"]),
    ({"seed": "abc"}, ["seed='abc'", "not an integer", "whole number"]),
    ({"stop": 42}, ["stop=42", "int", "set stop to a string or a list of strings"]),
    ({"stop": ["ok", 7]}, ["7", "int", "every stop entry must be a string"]),
    ({"stop": ["ok", ""]}, ["empty string", "remove it"]),
    ({"stop_token_ids": [3, -1]}, ["-1", "integer 0 or more"]),
    ({"stop_token_ids": "2"}, ["stop_token_ids='2'", "str", "list of token ids"]),
    ({"stop": ["END"], "detokenize": False}, ["detokenize=False", "set detokenize=True", "stop_token_ids"]),
]


@pytest.mark.parametrize(("kwargs", "fragments"), BAD_VALUES, ids=[str(kw) for kw, _ in BAD_VALUES])
def test_bad_value_is_refused_with_value_limit_and_fix(kwargs: dict, fragments: list[str]) -> None:
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    message = str(excinfo.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from {message!r}"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"top_k": 0},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"temperature": 0.0},
        {"min_tokens": 16, "max_tokens": 16},
        {"max_tokens": None, "min_tokens": 1000},
        {"logprobs": 0, "prompt_logprobs": 0},
    ],
)
def test_limits_themselves_are_accepted(kwargs: dict) -> None:
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == value


def test_stop_is_normalised_to_a_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop_token_ids=(5, 7)).stop_token_ids == [5, 7]
    assert SamplingParams(stop=None).stop == []


def test_top_k_minus_one_means_off_and_is_stored_as_zero() -> None:
    assert SamplingParams(top_k=-1).top_k == 0


def test_sampling_type() -> None:
    assert SamplingParams(temperature=0.0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=9e-6, seed=3).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-4).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=3).sampling_type == SamplingType.RANDOM_SEED


def test_max_stop_str_len() -> None:
    assert SamplingParams().max_stop_str_len == 0
    assert SamplingParams(stop=["a", "four", "ab"]).max_stop_str_len == 4


def test_from_optional_keeps_defaults_for_none() -> None:
    params = SamplingParams.from_optional(temperature=None, top_p=0.5, max_tokens=None, stop=None)
    assert params.temperature == 1.0
    assert params.top_p == 0.5
    assert params.max_tokens == 16
    assert params.stop == []


def test_from_optional_names_unknown_parameters() -> None:
    with pytest.raises(ValueError, match=r"unknown sampling parameter\(s\) \['topp'\].*top_p"):
        SamplingParams.from_optional(topp=0.5)


def test_clone_is_independent() -> None:
    params = SamplingParams(stop=["x"], stop_token_ids=[1], seed=4)
    copy = params.clone()
    copy.stop.append("y")
    copy.stop_token_ids.append(2)
    copy.seed = 5
    assert params.stop == ["x"]
    assert params.stop_token_ids == [1]
    assert params.seed == 4
    assert copy == SamplingParams(stop=["x", "y"], stop_token_ids=[1, 2], seed=5)
