"""Speculative decoding with a draft model (method draft_model) through the whole engine on tiny random
models (CPU): lossless against the same engine without it, greedy token for token and, with temperature,
in distribution; the draft's KV state through back-off, preemption, n > 1 and stops; bad configs refused
before loading; the draft counted in the memory plan."""

from __future__ import annotations

import json
import logging
from collections import Counter

import pytest

from fitserve import SamplingParams
from fitserve.args import EngineArgs
from fitserve.planner.resolve import plan_settings
from tests.model_folders import save_with_tokenizer
from tests.unit.model_helpers import build_hf_model, tiny_hf_config
from tests.unit.test_engine_vs_hf import make_llm, save_tiny_model
from tests.unit.test_spec_decode_engine import (
    _chi_square_p_value,
    _generate,
    _prompts,
    _token_ids,
    each_engine_setting,
)

K = 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    save_tiny_model(path, "LlamaForCausalLM")
    return path


def _save_draft(path, architecture: str, seed: int, **overrides):
    """A tiny model of another seed (and maybe architecture or shape), with the target's tokenizer."""
    config = tiny_hf_config(architecture, **overrides)
    return save_with_tokenizer(build_hf_model(config, seed=seed), path)


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    """Another architecture of the same vocabulary, random weights: its drafts are mostly refused."""
    return _save_draft(tmp_path_factory.mktemp("draft"), "Qwen3ForCausalLM", seed=21, num_hidden_layers=1)


def _draft(model, k: int = K) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


def _mean_acceptance_length(llm) -> float:
    stats = llm.engine.speculator.stats
    return 1 + stats.num_accepted_tokens / stats.num_drafts


@each_engine_setting
def test_the_target_as_its_own_draft_is_always_accepted(folder, llm_kwargs):
    prompts = _prompts()
    plain = make_llm(folder, **llm_kwargs)
    spec = make_llm(folder, speculative_config=_draft(folder), **llm_kwargs)
    expected = _generate(plain, prompts, max_tokens=40, logprobs=2)
    got = _generate(spec, prompts, max_tokens=40, logprobs=2)
    assert _token_ids(got) == _token_ids(expected)
    for want, have in zip(expected, got):
        for w, h in zip(want[0].logprobs, have[0].logprobs):
            assert w.keys() == h.keys()
            for token in w:
                assert abs(w[token].logprob - h[token].logprob) < 1e-4
    stats = spec.engine.speculator.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    # k + 1 tokens a step, but for the last drafts of a request, cut short by max_tokens
    assert _mean_acceptance_length(spec) > K + 0.5
    if llm_kwargs.get("enable_prefix_caching", True):
        # again: the target finds the prompts in its prefix cache, the draft computes them afresh
        hits = spec.engine.kv_manager.prefix_cache_hits
        assert _token_ids(_generate(spec, prompts, max_tokens=40)) == _token_ids(expected)
        assert spec.engine.kv_manager.prefix_cache_hits > hits
        assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_a_random_draft_is_exact_and_mostly_refused(folder, random_draft):
    prompts = _prompts(4, seed=1)
    plain = make_llm(folder)
    spec = make_llm(folder, speculative_config=_draft(random_draft))
    assert _token_ids(_generate(spec, prompts, max_tokens=30)) == _token_ids(
        _generate(plain, prompts, max_tokens=30)
    )
    stats = spec.engine.speculator.stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens < 0.3 * stats.num_draft_tokens


def test_the_draft_catches_up_after_steps_without_drafts(folder, random_draft):
    """A step that does not speculate (the back-off) leaves the draft behind; it computes what it missed
    at its next draft: still exact, and with its own weights still always accepted."""
    prompts = _prompts(3, seed=2)
    plain = make_llm(folder)
    expected = _token_ids(_generate(plain, prompts, max_tokens=30))
    for draft, all_accepted in ((folder, True), (random_draft, False)):
        spec = make_llm(folder, speculative_config=_draft(draft))
        speculator = spec.engine.speculator
        wants = speculator.wants_drafts
        calls = []

        def every_third(running, wants=wants, calls=calls):
            calls.append(1)
            return len(calls) % 3 == 0 and wants(running)

        speculator.wants_drafts = every_third
        assert _token_ids(_generate(spec, prompts, max_tokens=30)) == expected
        stats = speculator.stats
        assert stats.num_draft_tokens > 0
        if all_accepted:
            assert stats.num_accepted_tokens == stats.num_draft_tokens


@pytest.mark.parametrize(
    "params",
    [
        {"max_tokens": 5},
        {"max_tokens": 2},
        {"max_tokens": 30, "repetition_penalty": 1.3, "frequency_penalty": 0.2},
        {"max_tokens": 30, "min_tokens": 4},
    ],
    ids=["max-tokens-mid-draft", "max-tokens-2", "penalties", "min-tokens"],
)
def test_limits_and_penalties_equal_without_speculation(folder, params):
    prompts = _prompts(4, seed=3)
    plain = make_llm(folder)
    spec = make_llm(folder, speculative_config=_draft(folder))
    assert _token_ids(_generate(spec, prompts, **params)) == _token_ids(_generate(plain, prompts, **params))


def test_preemption_and_n_greater_than_1(folder, random_draft):
    prompts = _prompts(6, seed=5)
    kwargs = {"num_gpu_blocks_override": 14, "max_num_seqs": 6}
    plain = make_llm(folder, **kwargs)
    params = {"max_tokens": 30, "n": 2, "temperature": 0}
    expected = _token_ids(_generate(plain, prompts, **params))
    for draft in (folder, random_draft):
        spec = make_llm(folder, speculative_config=_draft(draft), **kwargs)
        assert _token_ids(_generate(spec, prompts, **params)) == expected
        assert spec.engine.scheduler.num_preemptions_total > 0
        # every request's draft state is given back once it finished (at the next draft: none left)
        draft_model = spec.engine.speculator.draft
        draft_model.propose([], set())
        assert not draft_model.sequences
        assert draft_model.kv_manager.num_free_blocks == draft_model.kv_manager.pool.num_usable_blocks


def test_stop_strings_and_stop_tokens_inside_drafts(folder):
    prompts = _prompts(3, seed=9)
    plain = make_llm(folder)
    first = _generate(plain, prompts, max_tokens=24)
    text = first[0][0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "the tiny model's text has a stop string to find"
    stop_token = list(first[1][0].token_ids)[6]
    spec = make_llm(folder, speculative_config=_draft(folder))
    for params in ({"stop": [stop]}, {"stop_token_ids": [stop_token]}):
        got = _generate(spec, prompts, max_tokens=24, **params)
        want = _generate(plain, prompts, max_tokens=24, **params)
        assert [o[0].text for o in got] == [o[0].text for o in want]
        assert _token_ids(got) == _token_ids(want)
    assert got[1][0].finish_reason == "stop"


def test_sampling_keeps_the_target_distribution(folder):
    """Seeded samples with and without the draft (its greedy drafts are taken only when the sample
    agrees): the same distribution of the first tokens by a chi-square test."""
    prompt = _prompts(1, seed=6)[0]
    plain = make_llm(folder, max_num_seqs=64)
    spec = make_llm(folder, speculative_config=_draft(folder), max_num_seqs=64)
    params = {"temperature": 1.0, "top_k": 3, "max_tokens": 4, "n": 600}
    plain_paths = Counter(tuple(c[1:3]) for c in _token_ids(_generate(plain, [prompt], seed=11, **params))[0])
    spec_paths = Counter(tuple(c[1:3]) for c in _token_ids(_generate(spec, [prompt], seed=12, **params))[0])
    stats = spec.engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts were both taken and refused
    assert _chi_square_p_value(plain_paths, spec_paths) > 1e-3


def test_counters_reach_the_engine_stats(folder):
    spec = make_llm(folder, speculative_config=_draft(folder))
    before = spec.engine.get_stats()
    _generate(spec, _prompts(3, seed=8), max_tokens=30)
    after = spec.engine.get_stats()
    stats = spec.engine.speculator.stats
    assert after.spec_num_draft_tokens == stats.num_draft_tokens > 0
    assert after.spec_num_accepted_tokens == stats.num_accepted_tokens
    assert after.num_generation_tokens_total - before.num_generation_tokens_total == 3 * 30


def test_model_without_method_means_draft_model(folder):
    spec = make_llm(folder, speculative_config={"model": str(folder), "num_speculative_tokens": 2})
    assert spec.engine.speculator.draft is not None
    assert spec.engine.config.speculative.method == "draft_model"


@pytest.fixture(scope="module")
def bad_drafts(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    (root / "vocab").mkdir()
    (root / "short").mkdir()
    return {
        "vocab": _save_draft(root / "vocab", "LlamaForCausalLM", seed=1, vocab_size=300),
        "short": _save_draft(root / "short", "LlamaForCausalLM", seed=1, max_position_embeddings=128),
    }


@pytest.mark.parametrize(
    ("config", "kwargs", "match"),
    [
        ({"method": "draft_model", "num_speculative_tokens": 3}, {}, 'draft_model needs "model"'),
        ({"method": "draft_model", "model": "vocab", "num_speculative_tokens": 3}, {}, "vocabulary of 300"),
        (
            {"method": "draft_model", "model": "short", "num_speculative_tokens": 3},
            {},
            "reads at most 128 tokens, fewer than max_model_len 512: set --max-model-len 128",
        ),
        (
            {
                "method": "draft_model",
                "model": "target",
                "num_speculative_tokens": 3,
                "draft_tensor_parallel_size": 2,
            },
            {},
            "draft_tensor_parallel_size 2 \\(target --tensor-parallel-size 1\\) is not built: .* set "
            "draft_tensor_parallel_size 1",
        ),
    ],
    ids=["no-model", "vocab", "short-context", "draft-tp"],
)
def test_bad_draft_configs_are_refused_before_loading(folder, bad_drafts, config, kwargs, match, monkeypatch):
    import fitserve.models.loader as loader
    import fitserve.worker.model_runner as model_runner

    names = {"target": str(folder), **{k: str(v) for k, v in bad_drafts.items()}}
    if "model" in config:
        config = {**config, "model": names[config["model"]]}
    loaded = []
    original = loader.load_model
    for module in (loader, model_runner):
        monkeypatch.setattr(module, "load_model", lambda *a, **k: loaded.append(1) or original(*a, **k))
    with pytest.raises(ValueError, match=match):
        make_llm(folder, speculative_config=config, **kwargs)
    assert not loaded  # refused before any weight loads


def test_a_draft_not_smaller_than_the_target_is_warned_about(folder, caplog):
    with caplog.at_level(logging.WARNING, logger="fitserve"):
        make_llm(folder, speculative_config=_draft(folder))
    assert "not fewer than the target's" in caplog.text


def test_the_plan_counts_the_draft(folder, random_draft):
    from fitserve.planner.report import plan_json, plan_text

    base = {"model": str(folder), "device": "cpu", "dtype": "float32", "cpu_kv_cache_space": 0.01}
    plain = plan_settings(EngineArgs(**base)).plan
    fit = plan_settings(EngineArgs(**base, speculative_config=_draft(random_draft)))
    plan = fit.plan
    # the draft: 1 layer of 2 KV heads x head_dim (Qwen3's own, not hidden / heads) in float32, K and V
    head_dim = json.loads((random_draft / "config.json").read_text())["head_dim"]
    draft_per_token = 2 * 1 * 2 * head_dim * 4
    assert plan.kv_bytes_per_token == plain.kv_bytes_per_token + draft_per_token
    assert plan.estimated.weights > plain.estimated.weights
    assert plan.num_kv_blocks < plain.num_kv_blocks  # the same space holds fewer tokens
    text = plan_text(fit)
    assert f"draft {random_draft.name}" in text
    assert plan_json(fit)["draft_model"]["kv_bytes_per_token"] == draft_per_token


def test_the_engine_sizes_both_pools_alike(folder, random_draft):
    spec = make_llm(folder, speculative_config=_draft(random_draft), num_gpu_blocks_override=None)
    engine = spec.engine
    draft = engine.speculator.draft
    assert draft.kv_manager.pool.num_blocks == engine.memory_plan.num_kv_blocks
    runner = engine.executor.runner
    assert runner.kv_bytes_per_block() == engine.memory_plan.block_bytes
    assert runner.draft_weight_bytes == draft.weight_bytes > 0


def test_grammars_cut_the_drafts_and_change_nothing(tmp_path):
    """Constrained requests beside a free one: the draft's greedy tokens are cut to what each grammar
    accepts (its own state, kept in its KV cache, goes on from the accepted ones)."""
    from fitserve import LLM
    from tests.unit.test_structured_greedy import CONSTRAINTS, EOS, MAX_TOKENS, PROMPTS, VOCAB

    config = tiny_hf_config("LlamaForCausalLM", vocab_size=VOCAB, eos_token_id=EOS)
    save_with_tokenizer(build_hf_model(config, seed=5), tmp_path)
    requests = [(name, PROMPTS[0]) for name in CONSTRAINTS] + [(None, PROMPTS[2])]
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS.get(name))
        for name, _ in requests
    ]
    prompts = [{"prompt_token_ids": p} for _, p in requests]
    kwargs = {"dtype": "float32", "num_gpu_blocks_override": 128, "block_size": 8}
    plain = LLM(str(tmp_path), **kwargs).generate(prompts, params, use_tqdm=False)
    spec_llm = LLM(str(tmp_path), speculative_config=_draft(tmp_path), **kwargs)
    spec = spec_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    stats = spec_llm.engine.speculator.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_drafts_after_a_rollback_equal_drafts_computed_afresh(folder):
    """The draft's kept keys and values after refused, partly accepted and fully accepted drafts give the
    drafts a draft state computed from nothing gives; with the target's own weights they are the
    target's greedy tokens."""
    from fitserve.core.request import Request

    llm = make_llm(folder, speculative_config=_draft(folder, k=4))
    draft = llm.engine.speculator.draft
    prompt = _prompts(1, seed=10)[0]
    greedy = _token_ids(_generate(make_llm(folder), [prompt], max_tokens=30))[0][0]
    request = Request("r", "r", 0, prompt, SamplingParams(max_tokens=64), frozenset())

    def propose() -> list[int]:
        (drafts,) = draft.propose([request], {"r"})
        return drafts

    def afresh() -> list[int]:
        draft.propose([], set())  # frees every draft state
        return propose()

    assert propose() == greedy[:4]
    # what verify steps could leave: the first draft refused; one accepted then a correction; all four
    # accepted and a bonus token; then a step without drafts (two tokens the draft never saw)
    for gained in ([7], [greedy[0], 9], None, [11, 12]):
        drafts = propose()
        if gained is None:
            gained = drafts + [13]
        for token in gained:
            request.append_output_token(token)
        incremental = propose()
        assert incremental == afresh()
    # it holds every known token, and the three drafts it fed back after them
    seq = draft.sequences["r"]
    assert (seq.num_computed_tokens, seq.drafted) == (request.num_tokens, tuple(incremental[:3]))


def test_a_finished_request_gives_its_draft_state_back_without_another_draft(folder):
    spec = make_llm(folder, speculative_config=_draft(folder))
    engine = spec.engine
    draft = engine.speculator.draft
    prompts = _prompts(2, seed=12)
    for i, (prompt, max_tokens) in enumerate(zip(prompts, (4, 40))):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(str(i), None, prompt, params)
    for _ in range(10):  # until request 0 has a draft state and is still running
        engine.step()
        if "0" in draft.sequences and "0" in engine.scheduler.requests:
            break
    engine.speculator.wants_drafts = lambda running: False  # no further drafts: only the release frees
    for _ in range(10):
        if "0" not in engine.scheduler.requests:
            break
        engine.step()
    engine.step()  # the schedule after it finished
    assert "0" not in draft.sequences and "1" in draft.sequences
