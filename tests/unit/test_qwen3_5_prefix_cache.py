"""Prefix caching on hybrid models (core/state_slots.py, --mamba-cache-mode): a second chat turn resumes
from the recurrent state snapshotted at a block boundary of the first, with KV blocks of 16 tokens.

On tiny random Qwen3.5 models (dense and MoE): the second turn's prefix-cache hit is > 0 (engine stats),
it computes only the tokens past the hit, and its greedy tokens and logprobs equal a cold run's (a fresh
engine) within 1e-4; a one-slot snapshot pool under several conversations, and preemption, stay correct;
--mamba-cache-mode none takes no hits; all and unknown values are refused naming the choices."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from fitserve import LLM, SamplingParams
from fitserve.args import EngineArgs
from fitserve.config import SchedulerConfig
from fitserve.core.kv_cache import KVCacheManager
from fitserve.core.request import Request
from fitserve.core.sampling_params import SamplingParams as CoreSamplingParams
from fitserve.core.scheduler import Scheduler
from fitserve.core.state_slots import StateSlotKVManager, num_state_slots, state_slots_of
from tests.model_folders import save_with_tokenizer
from tests.unit.qwen3_5_helpers import build_hf, make_config

BLOCK = 16
NEW_TOKENS = 12
_generator = torch.Generator().manual_seed(11)
FIRST = torch.randint(0, 256, (150,), generator=_generator).tolist()  # 9 full blocks and 6 tokens
NEXT_USER = torch.randint(0, 256, (23,), generator=_generator).tolist()
OTHERS = [torch.randint(0, 256, (n,), generator=_generator).tolist() for n in (90, 120, 70)]


@pytest.fixture(scope="module", params=["dense-causal", "moe-conditional"])
def tiny_model(request, tmp_path_factory) -> Path:
    family, form = request.param.split("-")
    model = build_hf(make_config(moe=family == "moe", conditional=form == "conditional"), seed=5)
    return save_with_tokenizer(model, tmp_path_factory.mktemp(f"prefix-{request.param}"))


def make_llm(folder: Path, **kwargs) -> LLM:
    kwargs.setdefault("num_gpu_blocks_override", 128)
    kwargs.setdefault("max_num_seqs", 2)
    return LLM(str(folder), dtype="float32", block_size=BLOCK, **kwargs)


def run(llm: LLM, prompt: list[int]):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]


def assert_same(out, cold) -> None:
    assert out.outputs[0].token_ids == cold.outputs[0].token_ids
    for position, reference in zip(out.outputs[0].logprobs, cold.outputs[0].logprobs, strict=True):
        for token_id, entry in reference.items():
            assert abs(position[token_id].logprob - entry.logprob) < 1e-4


def second_turn(first_out) -> list[int]:
    return FIRST + list(first_out.outputs[0].token_ids) + NEXT_USER


def test_second_turn_resumes_from_the_first(tiny_model):
    llm = make_llm(tiny_model)
    engine = llm.engine
    first = run(llm, FIRST)
    prompt = second_turn(first)
    before = engine.get_stats()
    out = run(llm, prompt)
    stats = engine.get_stats()
    hits = stats.prefix_cache_hits - before.prefix_cache_hits
    assert stats.prefix_cache_queries - before.prefix_cache_queries == len(prompt)
    # the first turn kept the state at its last block boundary: 150 prompt + 11 computed outputs -> 160
    assert hits == 160 and out.num_cached_tokens == 160
    cold = run(make_llm(tiny_model), prompt)
    assert cold.num_cached_tokens == 0
    assert_same(out, cold)


def test_computes_only_the_tokens_past_the_hit(tiny_model):
    llm = make_llm(tiny_model)
    first = run(llm, FIRST)
    prompt = second_turn(first)
    engine = llm.engine
    computed: list[tuple[int, int]] = []
    schedule = engine.scheduler.schedule

    def recording():
        output = schedule()
        computed.extend((item.start, item.num_new_tokens) for item in output.scheduled)
        return output

    engine.scheduler.schedule = recording
    run(llm, prompt)
    hit = 160
    prefill = [(start, n) for start, n in computed if start < len(prompt)]
    assert prefill[0][0] == hit  # the first step starts past the hit
    assert sum(n for start, n in prefill if start < len(prompt)) == len(prompt) - hit
    # align mode: the prompt's chunk ends on the last block boundary before the prompt's end, then the rest
    assert prefill[0][0] + prefill[0][1] == len(prompt) // BLOCK * BLOCK


def test_prompt_of_whole_blocks_and_repeats(tiny_model):
    """The same prompt again: the hit stops one block short of its end (a token is always computed), where
    the first run's prefill kept the state."""
    llm = make_llm(tiny_model)
    prompt = FIRST[:144]  # 9 whole blocks
    first = run(llm, prompt)
    again = run(llm, prompt)
    assert again.num_cached_tokens == 128  # the first run's prefill was 128 + 16
    assert_same(again, first)


def test_small_snapshot_pool_with_several_conversations(tiny_model):
    """Two snapshot slots (max_num_seqs 1) shared by interleaved conversations: each second turn resumes
    from whatever is still kept, or computes in full, and always equals a cold run."""
    llm = make_llm(tiny_model, max_num_seqs=1)
    assert llm.engine.kv_manager.snapshots.count == 2
    cold_llm = make_llm(tiny_model, max_num_seqs=1, enable_prefix_caching=False)
    firsts = [run(llm, prompt) for prompt in OTHERS]
    hits = []
    for i in (2, 0, 1):
        follow = OTHERS[i] + list(firsts[i].outputs[0].token_ids) + NEXT_USER
        out = run(llm, follow)
        hits.append(out.num_cached_tokens)
        assert_same(out, run(cold_llm, follow))
    # only the last conversation's snapshots were still kept; each later turn evicted the ones before
    assert hits[0] > 0 and hits[1:] == [0, 0]


def test_preemption_with_snapshots(tiny_model):
    """A tight KV cache: requests are preempted and recomputed (resuming from their own snapshots) and
    their output equals a cold run's."""
    prompts = [FIRST, *OTHERS]
    llm = make_llm(tiny_model, num_gpu_blocks_override=20, max_num_seqs=4, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions_total > 0
    cold = make_llm(tiny_model, enable_prefix_caching=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == run(cold, prompt).outputs[0].token_ids
    manager = llm.engine.kv_manager
    assert manager.state_slots.num_free == manager.state_slots.num_slots - 1


def test_parallel_samples_share_the_prompt(tiny_model):
    """n=2: the second sample waits for the first's prompt, then resumes from its prompt snapshot (the
    state after 144 of 150 tokens) in the same engine step as the first's decode."""
    llm = make_llm(tiny_model)
    params = SamplingParams(n=2, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": FIRST}], params, use_tqdm=False)[0]
    cold = run(make_llm(tiny_model, enable_prefix_caching=False), FIRST)
    assert [o.token_ids for o in out.outputs] == [cold.outputs[0].token_ids] * 2
    assert llm.engine.get_stats().prefix_cache_hits == 144


def test_mode_none_takes_no_hits(tiny_model):
    llm = make_llm(tiny_model, mamba_cache_mode="none")
    first = run(llm, FIRST)
    out = run(llm, second_turn(first))
    stats = llm.engine.get_stats()
    assert out.num_cached_tokens == 0 and stats.prefix_cache_hits == 0 and stats.prefix_cache_queries > 0
    assert llm.engine.kv_manager.snapshots.count == 0
    assert llm.engine.executor.runner.model.state_pool.slots == 3  # max_num_seqs 2 + the spare


def test_bad_and_unsupported_modes_are_refused(tiny_model):
    with pytest.raises(ValueError, match="mamba_cache_mode='sometimes' is not one of none, align, all"):
        make_llm(tiny_model, mamba_cache_mode="sometimes")
    with pytest.raises(ValueError, match="--mamba-cache-mode all is not supported"):
        make_llm(tiny_model, mamba_cache_mode="all")


def test_cli_refuses_unknown_mode(capsys):
    from fitserve.cli.main import parse_command

    with pytest.raises(SystemExit):
        parse_command(["serve", "--mamba-cache-mode", "sometimes"])
    err = capsys.readouterr().err
    assert "invalid choice: 'sometimes'" in err and "align" in err and "none" in err


# ---- the scheduler side alone ------------------------------------------------------------------------


def make_scheduler(num_snapshots: int, budget: int = 64, num_blocks: int = 64) -> Scheduler:
    manager = StateSlotKVManager(KVCacheManager(num_blocks, 4, True), num_state_slots(2), num_snapshots)
    return Scheduler(
        SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=budget, max_model_len=256), manager
    )


def make_request(request_id: str, tokens: list[int], max_tokens: int = 3) -> Request:
    params = CoreSamplingParams(max_tokens=max_tokens)
    return Request(request_id, request_id, 0, tokens, params, frozenset({0}))


def drive(scheduler: Scheduler) -> list:
    steps = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        steps.append((out, state_slots_of(out.scheduled)))
        scheduler.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})
    return steps


def test_scheduler_aligns_chunks_saves_and_restores():
    scheduler = make_scheduler(num_snapshots=2)
    tokens = list(range(1, 19))  # 18 tokens: blocks of 4 -> the prompt runs as 16 + 2
    steps = drive_one(scheduler, make_request("a", tokens))
    first_out, first_slots = steps[0]
    assert [(s.start, s.num_new_tokens) for s in first_out.scheduled] == [(0, 16)]
    assert first_slots.saves == {0: 3}  # the first snapshot slot comes after live slots 0..2
    second_turn = make_request("b", tokens + [7, 7, 7, 9])  # 22 tokens
    steps = drive_one(scheduler, second_turn)
    out, slots = steps[0]
    # the first request kept 16 (prefill) and 20 (a decode step ending on a boundary)
    assert out.scheduled[0].start == 20 and slots.restores == {0: 4}
    assert second_turn.num_cached_tokens == 20


def drive_one(scheduler: Scheduler, request: Request) -> list:
    scheduler.add_request(request)
    return drive(scheduler)


def test_scheduler_without_snapshots_takes_no_hits():
    scheduler = make_scheduler(num_snapshots=0)
    tokens = list(range(1, 19))
    steps = drive_one(scheduler, make_request("a", tokens))
    assert [(s.start, s.num_new_tokens) for s in steps[0][0].scheduled] == [(0, 18)]  # no alignment
    steps = drive_one(scheduler, make_request("b", tokens + [7, 7, 9]))
    assert steps[0][0].scheduled[0].start == 0 and scheduler.kv_manager.prefix_cache_hits == 0


# ---- the planner: the snapshot slots come out of the budget --------------------------------------------


@pytest.mark.parametrize(
    ("mode", "max_num_seqs", "snapshots"), [("align", 2, 4), ("align", 64, 16), ("none", 8, 0)]
)
def test_planner_counts_the_snapshot_slots(mode, max_num_seqs, snapshots):
    from fitserve.planner.memory import plan_memory
    from tests.unit.planner_helpers import memory_inputs
    from tests.unit.test_qwen3_5_planner import STATE_PER_SEQ

    per_seq = STATE_PER_SEQ["qwen3.6-27b"]
    inputs = memory_inputs("qwen3.6-27b", max_model_len=32_768, max_num_seqs=max_num_seqs)
    plan = plan_memory(dataclasses.replace(inputs, mamba_cache_mode=mode))
    assert plan.state_snapshot_bytes == snapshots * per_seq
    assert plan.recurrent_state_bytes == (max_num_seqs + 1 + snapshots) * per_seq
    assert plan.free_for_kv_bytes == plan.budget_bytes - plan.terms.total - plan.recurrent_state_bytes


def test_field_report_flags_plan():
    from fitserve.planner.fit import auto_fit
    from fitserve.planner.hardware import parse_assume_gpus
    from fitserve.planner.report import plan_text
    from tests.unit.planner_helpers import H100, model_info

    args = EngineArgs(
        max_model_len=32_768, max_num_seqs=1, enable_prefix_caching=True, mamba_cache_mode="align"
    )
    result = auto_fit(model_info("qwen3.6-27b"), args, parse_assume_gpus(H100), serving=True)
    assert result.plan.inputs.mamba_cache_mode == "align"
    assert "state snapshots (2 x 146.8 MiB)" in plan_text(result)
    off = auto_fit(
        model_info("qwen3.6-27b"),
        dataclasses.replace(args, enable_prefix_caching=False),
        parse_assume_gpus(H100),
        serving=True,
    )
    assert off.plan.inputs.mamba_cache_mode == "none" and off.plan.state_snapshot_bytes == 0
