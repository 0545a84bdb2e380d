"""A request that fails inside an engine step ends alone (finish_reason "error" with a message); a step
that fails as a whole ends only its own requests; the engine goes on either way."""

from __future__ import annotations

import pytest

from fitserve import SamplingParams
from fitserve.core.sampling_params import SEED_MAX, SEED_MIN
from tests.unit.test_engine_vs_hf import make_llm, save_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_model(folder, "LlamaForCausalLM")
    return make_llm(folder)


def run_to_end(engine) -> dict:
    finals = {}
    for _ in range(200):
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        if not engine.has_unfinished_requests():
            return finals
    raise AssertionError("the engine did not finish")


def test_one_request_whose_own_work_raises_ends_alone(llm, monkeypatch, caplog) -> None:
    engine = llm.engine
    runner = engine.executor.runner
    make_row = runner._sampling_row

    def failing_for_bad(item):
        if item.request.parent_id == "bad":
            raise ValueError("injected failure for one request")
        return make_row(item)

    expected = llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)[0]
    monkeypatch.setattr(runner, "_sampling_row", failing_for_bad)
    engine.add_request("good", None, [5, 6, 7], GREEDY)
    engine.step()  # "good" is running when "bad" arrives
    engine.add_request("bad", None, [9, 8, 7, 6, 5, 4, 3, 2, 1], GREEDY)
    with caplog.at_level("ERROR", logger="fitserve"):
        finals = run_to_end(engine)
    bad, good = finals["bad"], finals["good"]
    assert bad.outputs[0].finish_reason == "error" and bad.error is not None
    assert "ValueError" in bad.error and "the other requests go on" in bad.error
    assert "injected failure" not in bad.error  # the raw text goes to the log only
    assert any("injected failure" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)
    assert good.error is None and good.outputs[0].finish_reason == "length"
    assert good.outputs[0].token_ids == expected.outputs[0].token_ids
    assert engine.get_stats().kv_cache_usage == 0.0


def test_a_request_failing_with_a_running_sibling_fails_every_choice_of_it_only(llm, monkeypatch) -> None:
    engine = llm.engine
    runner = engine.executor.runner
    make_row = runner._sampling_row

    def failing_second_choice(item):
        if item.request.request_id == "n2#1":
            raise RuntimeError("boom")
        return make_row(item)

    monkeypatch.setattr(runner, "_sampling_row", failing_second_choice)
    engine.add_request("n2", None, [1, 2, 3, 4], SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=4))
    engine.add_request("other", None, [4, 3, 2, 1], GREEDY)
    finals = run_to_end(engine)
    assert [c.finish_reason for c in finals["n2"].outputs] == ["error", "error"]
    assert finals["other"].error is None and len(finals["other"].outputs[0].token_ids) == 6


def test_a_step_failing_as_a_whole_ends_its_requests_and_the_engine_goes_on(llm, monkeypatch) -> None:
    engine = llm.engine
    launch = engine.executor.launch
    calls = {"n": 0}

    def launch_failing_once(scheduler_output, *args):
        if not scheduler_output.is_empty:
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("internal details /secret/path")
        return launch(scheduler_output, *args)

    monkeypatch.setattr(engine.executor, "launch", launch_failing_once)
    engine.add_request("a", None, [5, 6, 7], GREEDY)
    finals = run_to_end(engine)
    assert finals["a"].outputs[0].finish_reason == "error"
    assert "RuntimeError" in finals["a"].error and "/secret/path" not in finals["a"].error
    after = llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)[0]
    assert after.error is None and len(after.outputs[0].token_ids) == 6


def test_a_failure_taking_a_steps_tokens_ends_that_steps_requests(llm, monkeypatch) -> None:
    engine = llm.engine
    take = engine._take_tokens
    calls = {"n": 0}

    def take_failing_once(step):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device error")
        return take(step)

    monkeypatch.setattr(engine, "_take_tokens", take_failing_once)
    engine.add_request("a", None, [5, 6, 7], GREEDY)
    finals = run_to_end(engine)
    assert finals["a"].outputs[0].finish_reason == "error"
    assert engine.get_stats().kv_cache_usage == 0.0


@pytest.mark.parametrize("seed", [SEED_MIN, SEED_MAX])
def test_seeds_at_the_bounds_run_with_several_choices(llm, seed: int) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=seed, max_tokens=3, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0]
    assert output.error is None and all(len(c.token_ids) == 3 for c in output.outputs)


@pytest.mark.parametrize("seed", [SEED_MAX + 1, SEED_MIN - 1, 2**64 - 1])
def test_seeds_outside_64_bits_are_refused(seed: int) -> None:
    with pytest.raises(ValueError, match=r"seed=-?\d+ is outside the range \[-2\*\*63, 2\*\*63-1\]"):
        SamplingParams(seed=seed)


def test_blocks_a_failed_step_never_wrote_leave_the_prefix_cache(llm, monkeypatch) -> None:
    engine = llm.engine
    launch = engine.executor.launch
    prompt = list(range(100, 120))  # two full blocks of 8, hashed when the step is planned

    def launch_failing(scheduler_output, *args):
        if not scheduler_output.is_empty:
            raise RuntimeError("the step never ran")
        return launch(scheduler_output, *args)

    monkeypatch.setattr(engine.executor, "launch", launch_failing)
    engine.add_request("never-computed", None, prompt, GREEDY)
    assert run_to_end(engine)["never-computed"].outputs[0].finish_reason == "error"
    monkeypatch.setattr(engine.executor, "launch", launch)
    after = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0  # no hit on blocks whose KV was never computed
    again = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 16 and again.outputs[0].token_ids == after.outputs[0].token_ids
