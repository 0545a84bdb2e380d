"""Speculative decoding through the whole engine on tiny random models (CPU): lossless against the same
engine without it, greedy token for token and, with temperature, in distribution."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from fitserve import SamplingParams
from tests.unit.test_engine_vs_hf import make_llm, save_tiny_model

K = 3


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen3ForCausalLM"])
def folder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_model(path, request.param)
    return path


def _prompts(n: int = 5, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat themselves (so prompt lookup finds matches), of different lengths."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        phrase = [rng.randrange(5, 250) for _ in range(rng.randint(4, 9))]
        prompts.append(phrase * (2 + i % 3))
    return prompts


def _generate(llm, prompts, **params):
    params.setdefault("temperature", 0)
    params.setdefault("max_tokens", 24)
    params.setdefault("ignore_eos", True)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(**params), use_tqdm=False
    )
    return [o.outputs for o in outputs]


def record_drafts(drafter) -> list[tuple[list[int], list[int]]]:
    """Wraps drafter.propose: the list it returns fills with (the request's tokens then, its drafts) for
    every request drafted for from now on."""
    records: list[tuple[list[int], list[int]]] = []
    propose = drafter.propose

    def recording(requests, running_ids):
        drafts = propose(requests, running_ids)
        records.extend((list(r.all_token_ids), d) for r, d in zip(requests, drafts) if d)
        return drafts

    drafter.propose = recording
    return records


def _token_ids(outputs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o] for o in outputs]


def _pair(folder, speculative_config, **llm_kwargs):
    return make_llm(folder, **llm_kwargs), make_llm(
        folder, speculative_config=speculative_config, **llm_kwargs
    )


# the engine settings every lossless check runs under: the defaults, and small steps (chunked prefill,
# several steps a prompt) without the prefix cache
each_engine_setting = pytest.mark.parametrize(
    "llm_kwargs",
    [{}, {"max_num_batched_tokens": 16, "max_num_seqs": 4, "enable_prefix_caching": False}],
    ids=["default", "chunked-no-prefix-cache"],
)
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


def _oracle_llm(folder, prompts, answers, miss=False, k=K, **llm_kwargs):
    llm = make_llm(folder, speculative_config={"method": "oracle", "num_speculative_tokens": k}, **llm_kwargs)
    vocab = llm.engine.config.model.vocab_size
    llm.engine.speculator.proposer.load(prompts, answers, vocab, miss=miss)
    return llm


@each_engine_setting
def test_ngram_greedy_equals_without_speculation(folder, llm_kwargs):
    prompts = _prompts()
    plain, spec = _pair(folder, NGRAM, **llm_kwargs)
    expected = _generate(plain, prompts, logprobs=2)
    got = _generate(spec, prompts, logprobs=2)
    assert _token_ids(got) == _token_ids(expected)
    for want, have in zip(expected, got):
        for w, h in zip(want[0].logprobs, have[0].logprobs):
            assert w.keys() == h.keys()
            for token in w:
                assert abs(w[token].logprob - h[token].logprob) < 1e-4
    stats = spec.engine.speculator.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0


def test_oracle_drafts_are_all_accepted_and_a_step_gains_k_plus_1(folder):
    prompts = _prompts(4, seed=1)
    plain = make_llm(folder)
    answers = [o[0] for o in _token_ids(_generate(plain, prompts, max_tokens=33))]
    llm = _oracle_llm(folder, prompts, answers)
    steps = 0
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(
            str(i), None, prompt, SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
        )
    finished = {}
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                finished[int(out.request_id)] = list(out.outputs[0].token_ids)
    assert [finished[i] for i in range(len(prompts))] == answers
    stats = engine.speculator.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    # 1 token from the prompt's step, then 32 in 8 verify steps of k + 1 = 4 (the drafted requests run
    # together); a few steps more for the prefill and the last step's tokens
    assert steps <= 1 + 32 // (K + 1) + 2


def test_zero_acceptance_is_still_exact_and_backs_off(folder):
    prompts = _prompts(3, seed=2)
    plain = make_llm(folder)
    answers = [o[0] for o in _token_ids(_generate(plain, prompts, max_tokens=60))]
    llm = _oracle_llm(folder, prompts, answers, miss=True)
    got = [o[0] for o in _token_ids(_generate(llm, prompts, max_tokens=60))]
    assert got == answers
    stats = llm.engine.speculator.stats
    assert stats.num_accepted_tokens == 0
    # after a window of misses speculation pauses: far fewer verify steps than decode steps
    assert 0 < stats.num_drafts < len(prompts) * 59 // 2


@pytest.mark.parametrize(
    "params",
    [
        {"max_tokens": 5},
        {"max_tokens": 30, "repetition_penalty": 1.3, "frequency_penalty": 0.2},
        {"max_tokens": 30, "min_tokens": 4},
    ],
    ids=["max-tokens-mid-draft", "penalties", "min-tokens"],
)
def test_limits_and_penalties_equal_without_speculation(folder, params):
    prompts = _prompts(4, seed=3)
    plain, spec = _pair(folder, NGRAM)
    assert _token_ids(_generate(spec, prompts, **params)) == _token_ids(_generate(plain, prompts, **params))


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there(folder):
    prompts = _prompts(3, seed=4)
    plain = make_llm(folder)
    answers = [o[0] for o in _token_ids(_generate(plain, prompts, max_tokens=20))]
    stop = answers[0][6]  # reached inside a verify step of the oracle's full drafts
    llm = _oracle_llm(folder, prompts, answers)
    got = _generate(llm, prompts, max_tokens=20, stop_token_ids=[stop])
    want = _generate(plain, prompts, max_tokens=20, stop_token_ids=[stop])
    assert _token_ids(got) == _token_ids(want)
    assert got[0][0].token_ids[-1] == stop and got[0][0].finish_reason == "stop"


def test_preemption_and_n_greater_than_1(folder):
    prompts = _prompts(6, seed=5)
    kwargs = {"num_gpu_blocks_override": 14, "max_num_seqs": 6}
    plain, spec = _pair(folder, NGRAM, **kwargs)
    params = {"max_tokens": 30, "n": 2, "temperature": 0}
    expected = _generate(plain, prompts, **params)
    got = _generate(spec, prompts, **params)
    assert _token_ids(got) == _token_ids(expected)
    assert spec.engine.scheduler.num_preemptions_total > 0


def _chi_square_p_value(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test of homogeneity (a 2 x m table), its p-value."""
    keys = sorted(set(a) | set(b))
    table = torch.tensor([[a[k] for k in keys], [b[k] for k in keys]], dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    df = torch.tensor(float(len(keys) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, statistic / 2))


def test_sampling_keeps_the_target_distribution(folder):
    """Many seeded samples of the first output tokens with and without speculation (the oracle drafts the
    greedy path, accepted only when the sample agrees): the same distribution by a chi-square test, and
    a test that tells a wrong one apart (always accepting the drafts)."""
    prompt = _prompts(1, seed=6)[0]
    plain = make_llm(folder, max_num_seqs=64)
    greedy = _token_ids(_generate(plain, [prompt], max_tokens=4))[0][0]
    llm = _oracle_llm(folder, [prompt], [greedy], max_num_seqs=64)
    params = {"temperature": 1.0, "top_k": 3, "max_tokens": 4, "n": 600}
    plain_paths = Counter(tuple(c[1:3]) for c in _token_ids(_generate(plain, [prompt], seed=11, **params))[0])
    spec_paths = Counter(tuple(c[1:3]) for c in _token_ids(_generate(llm, [prompt], seed=12, **params))[0])
    stats = llm.engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts were both taken and refused
    assert _chi_square_p_value(plain_paths, spec_paths) > 1e-3
    # the test can fail: always taking the greedy path is told apart
    greedy_paths = Counter({tuple(greedy[1:3]): 600})
    assert _chi_square_p_value(plain_paths, greedy_paths) < 1e-6


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"method": "eagle", "num_speculative_tokens": 3, "model": "x"}, "EAGLE-1 draft heads.*eagle3"),
        ({"method": "mtp", "num_speculative_tokens": 2}, "MTP layers.*not built"),
        ({"method": "medusa2", "num_speculative_tokens": 2}, "method 'medusa2' is unknown"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens is 0.*at least 1"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}, "unknown key.*lookahead"),
    ],
)
def test_bad_configs_are_refused_before_loading(folder, config, match):
    with pytest.raises(ValueError, match=match):
        make_llm(folder, speculative_config=config)


def test_tensor_parallel_2_with_speculation_equals_plain(folder):
    prompts = _prompts(3, seed=7)
    plain = make_llm(folder)
    expected = _token_ids(_generate(plain, prompts, max_tokens=20))
    answers = [o[0] for o in expected]
    spec = _oracle_llm(folder, prompts, answers, tensor_parallel_size=2)
    try:
        got = _token_ids(_generate(spec, prompts, max_tokens=20))
        stats = spec.engine.speculator.stats
    finally:
        spec.engine.shutdown()
    assert got == expected
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_counters_reach_the_engine_stats_and_the_metrics(folder):
    from fitserve.engine.stats_line import format_spec_decode_line
    from fitserve.server.metrics import ServerMetrics

    llm = make_llm(folder, speculative_config=NGRAM)
    before = llm.engine.get_stats()
    _generate(llm, _prompts(3, seed=8), max_tokens=30)
    after = llm.engine.get_stats()
    stats = llm.engine.speculator.stats
    assert after.spec_num_draft_tokens == stats.num_draft_tokens > 0
    assert after.spec_accepted_per_pos == tuple(stats.accepted_per_pos)
    # every accepted token is a generated token: the generation counter counts them all
    assert after.num_generation_tokens_total - before.num_generation_tokens_total == 3 * 30
    assert "SpecDecoding metrics: Mean acceptance length" in format_spec_decode_line(before, after)
    metrics = ServerMetrics("tiny", lambda: after)
    text = metrics.render()[0].decode()
    assert "vllm:spec_decode_num_draft_tokens_total{" in text
    assert f'position="0"}} {float(stats.accepted_per_pos[0])}' in text


def test_a_stop_string_inside_accepted_drafts_ends_the_text_there(folder):
    prompts = _prompts(2, seed=9)
    plain = make_llm(folder)
    first = _generate(plain, prompts, max_tokens=24)
    answers = [list(o[0].token_ids) for o in first]
    text = first[0][0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "the tiny model's text has a stop string to find"
    llm = _oracle_llm(folder, prompts, answers)
    got = _generate(llm, prompts, max_tokens=24, stop=[stop])
    want = _generate(plain, prompts, max_tokens=24, stop=[stop])
    assert [o[0].text for o in got] == [o[0].text for o in want]
    assert got[0][0].finish_reason == "stop" and stop not in got[0][0].text
