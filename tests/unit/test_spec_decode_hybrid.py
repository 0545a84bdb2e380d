"""Speculative decoding on a hybrid model (tiny random Qwen3.5: Gated DeltaNet layers beside a full
attention layer, CPU): the recurrent state kept per verified token and continued from the accepted one
(worker/state_rings.py, models/delta_net_chain.py). A verify step's chained rows against the layer run
token by token; the rings' positions; then the whole engine lossless against itself without
speculation: greedy token for token (ngram, the oracle's full and refused drafts, a draft model), through
preemption and prefix caching, and with temperature in distribution."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from fitserve import SamplingParams
from fitserve.core.kv_cache import hash_block
from fitserve.core.state_slots import StepStateSlots
from fitserve.layers.gated_delta_rule import split_state_rows
from fitserve.models.delta_net_chain import ChainedStepSlots
from fitserve.worker.recurrent_state import RecurrentStatePool, recurrent_state_layers
from fitserve.worker.state_rings import StateRings, verify_depths
from tests.model_folders import save_with_tokenizer
from tests.unit.qwen3_5_helpers import build_hf, make_config
from tests.unit.test_qwen3_5_engine import make_llm
from tests.unit.test_qwen3_5_step_slots import make_layer, metadata_for, per_sequence_reference, run_layer
from tests.unit.test_spec_decode_draft import _save_draft
from tests.unit.test_spec_decode_engine import (
    _chi_square_p_value,
    _generate,
    _oracle_llm,
    _prompts,
    _token_ids,
    each_engine_setting,
)

K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


# ---- one DeltaNet layer: a verify step's chain --------------------------------------------------------


def _rows(request, start: int, drafts: tuple[int, ...]) -> list[SimpleNamespace]:
    """A request's verify rows as spec_decode/verify.verify_rows makes them."""
    return [
        SimpleNamespace(request=request, start=start + j, num_new_tokens=1, draft_token_ids=drafts[:j])
        for j in range(len(drafts) + 1)
    ]


def verify_step(config) -> SimpleNamespace:
    """One DeltaNet layer (random weights, a pool of random states) and a verify step's rows: two requests
    verify drafts (one a full chain of k + 1 = 3 rows wrapping its ring onto the row it read, one of 2
    rows) beside a prompt piece and a plain decode row. Deterministic: the Triton interpreter's test
    builds it again in its child process."""
    layer, _ = make_layer(config)
    k, max_num_seqs = 2, 4
    rings = StateRings(max_num_seqs, 0, k)
    pool = RecurrentStatePool(
        recurrent_state_layers(config), rings.row(max_num_seqs, k) + 1, torch.float32, torch.device("cpu")
    )
    generator = torch.Generator().manual_seed(1)
    pool.conv[0].copy_(torch.randn(pool.conv[0].shape, generator=generator))
    pool.recurrent[0].copy_(torch.randn(pool.recurrent[0].shape, generator=generator) * 0.1)
    layer.conv_states, layer.recurrent_states = pool.conv[0], pool.recurrent[0]
    first, second, plain, prompt = (SimpleNamespace(state_slot=s) for s in (1, 3, 2, 4))
    rings._position[1] = 1  # the first request's state is at ring position 1 already
    scheduled = [
        *_rows(first, 9, (7, 8)),
        SimpleNamespace(request=prompt, start=2, num_new_tokens=4, draft_token_ids=()),
        SimpleNamespace(request=plain, start=5, num_new_tokens=1, draft_token_ids=()),
        *_rows(second, 6, (5,)),
    ]
    query_lens = [1, 1, 1, 4, 1, 1, 1]
    seq_lens = [10, 11, 12, 6, 6, 7, 8]
    rows, chain = rings.place(scheduled, StepStateSlots([1, 1, 1, 4, 2, 3, 3]), query_lens, seq_lens)
    assert chain is not None
    host = split_state_rows(query_lens, seq_lens, rows)
    chained = ChainedStepSlots.from_uploaded(
        host,
        [torch.from_numpy(a) for a in host.arrays()],
        [torch.from_numpy(a) for a in chain.arrays()],
        chain.sizes,
    )
    hidden = torch.randn(sum(query_lens), config.hidden_size, generator=generator)
    metadata = metadata_for(query_lens, seq_lens, list(rows), chained)
    return SimpleNamespace(
        layer=layer,
        pool=pool,
        rings=rings,
        scheduled=scheduled,
        rows=rows,
        chain=chain,
        chained=chained,
        hidden=hidden,
        metadata=metadata,
    )


def test_a_verify_step_keeps_the_state_after_each_token():
    """Each output and each token's state equal the layer run one token at a time, and each state lands
    in its own ring row."""
    config = make_config(moe=False, conditional=False)
    step = verify_step(config)
    rings, rows, chain, pool, layer = step.rings, step.rows, step.chain, step.pool, step.layer
    assert verify_depths(step.scheduled) == [0, 1, 2, None, None, 0, 1]
    # ring positions 2, 0, 1 of slot 1 (its last state on the row it started from), 1 and 2 of slot 3
    assert list(rows) == [rings.row(1, 2), 1, rings.row(1, 1), 4, 2, rings.row(3, 1), rings.row(3, 2)]
    assert [d.rows for d in chain.depths] == [[0, 3, 4], [1, 5], [2]]
    # per decode row: the row it continues from, and its chain's length where one starts
    assert chain.sources == [rings.row(1, 1), rings.row(1, 2), 1, 2, 3, rings.row(3, 1)]
    assert chain.lengths == [3, 0, 0, 1, 2, 0]
    assert not step.chained.is_decode_only  # run eagerly, never by a decode graph

    # the reference: each sequence's tokens one after another on the row it starts from (a copy of the pool)
    meta = step.metadata
    conv, recurrent = pool.conv[0].clone(), pool.recurrent[0].clone()
    sources = [rings.row(1, 1)] * 3 + [4, 2, 3, 3]
    want, states, token = [], [], 0
    for query_len, seq_len, source in zip(meta.query_lens_cpu, meta.seq_lens_cpu, sources, strict=True):
        tokens = slice(token, token + query_len)
        want.append(
            per_sequence_reference(
                layer, step.hidden[tokens], [query_len], [seq_len], [source], conv, recurrent
            )
        )
        states.append((conv[source].clone(), recurrent[source].clone()))
        token += query_len

    got = run_layer(layer, step.hidden, meta)
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-5, atol=1e-6)
    for i, (conv_state, recurrent_state) in enumerate(states):
        torch.testing.assert_close(pool.conv[0][rows[i]], conv_state, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pool.recurrent[0][rows[i]], recurrent_state, rtol=1e-5, atol=1e-6)


def test_the_ring_moves_to_the_last_kept_token():
    rings = StateRings(max_num_seqs=2, num_snapshots=3, speculative_tokens=K)
    assert rings.row(1, 0) == 1 and rings.row(1, 1) == 2 + 1 + 3 and rings.row(2, K) == 6 + 2 * K - 1
    request = SimpleNamespace(state_slot=2)
    slots = StepStateSlots([2] * (K + 1))
    rings.place(_rows(request, 20, (1, 2, 3)), slots, [1] * (K + 1), list(range(21, 25)))
    # the step kept the last known token and one draft: the next step starts at position 2
    nxt = SimpleNamespace(request=request, start=22, num_new_tokens=1, draft_token_ids=())
    rows, chain = rings.place([nxt], StepStateSlots([2]), [1], [23])
    assert chain is None and list(rows) == [rings.row(2, 2)]
    # all of them kept, twice (the ring wraps): 2 + 4 + 4 = position 2 again, then a preempted request
    for start in (22, 26):
        rings.place(_rows(request, start, (1, 2, 3)), StepStateSlots([2] * 4), [1] * 4, [30] * 4)
    rows, _ = rings.place([SimpleNamespace(**{**vars(nxt), "start": 30})], StepStateSlots([2]), [1], [31])
    assert list(rows) == [rings.row(2, 2)]
    rings.place(_rows(request, 30, (1,)), StepStateSlots([2] * 2), [1] * 2, [31, 32])
    request.state_slot = 1  # preempted meanwhile and back in another slot: its ring stays as it was
    back = SimpleNamespace(request=request, start=31, num_new_tokens=8, draft_token_ids=())
    rings.place([back], StepStateSlots([1]), [8], [39])
    assert rings.current_row(2) == rings.row(2, 2) and rings.current_row(1) == 1


# ---- the whole engine ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_with_tokenizer(
        build_hf(make_config(moe=False, conditional=False), seed=3), tmp_path_factory.mktemp("q35")
    )


def _pair(folder, speculative_config, **llm_kwargs):
    return make_llm(folder, **llm_kwargs), make_llm(
        folder, speculative_config=speculative_config, **llm_kwargs
    )


def _greedy(max_tokens: int = 28) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _echo_prompts(plain, n: int, seed: int) -> list[list[int]]:
    """Prompts p + (the model's greedy continuation of p) + p: prompt lookup then drafts that
    continuation, which the model's output after the second p follows in part (a random tiny model's
    output rarely repeats the prompt itself)."""
    prompts = _prompts(n, seed)
    answers = [o[0] for o in _token_ids(_generate(plain, prompts))]
    return [p + a + p for p, a in zip(prompts, answers, strict=True)]


@each_engine_setting
def test_ngram_greedy_equals_without_speculation(folder, llm_kwargs):
    plain, spec = _pair(folder, NGRAM, **llm_kwargs)
    prompts = _echo_prompts(plain, 4, seed=0)
    expected = _generate(plain, prompts, logprobs=2)
    got = _generate(spec, prompts, logprobs=2)
    assert _token_ids(got) == _token_ids(expected)
    for want, have in zip(expected, got, strict=True):
        for w, h in zip(want[0].logprobs, have[0].logprobs, strict=True):
            assert w.keys() == h.keys()
            for token in w:
                assert abs(w[token].logprob - h[token].logprob) < 1e-4
    stats = spec.engine.speculator.stats
    # drafts were both taken and refused: the state continued from the middle of a chain
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("miss", [False, True], ids=["all-accepted", "all-refused"])
def test_oracle_drafts_taken_or_refused_stay_exact(folder, miss):
    """Every draft accepted (the ring wraps every step) or none (the state after the last known token
    only): the same tokens as without speculation."""
    prompts = _prompts(3, seed=1)
    plain = make_llm(folder)
    answers = [o[0] for o in _token_ids(_generate(plain, prompts, max_tokens=30))]
    llm = _oracle_llm(folder, prompts, answers, miss=miss)
    assert [o[0] for o in _token_ids(_generate(llm, prompts, max_tokens=30))] == answers
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == (0 if miss else stats.num_draft_tokens)


def test_preemption_mid_speculation_and_n_greater_than_1(folder):
    """Too few KV blocks for every request: requests are preempted between verify steps (their rings
    left where they were) and recomputed; the oracle's drafts all accepted, so every step verifies."""
    kwargs = {"num_gpu_blocks_override": 16, "max_num_seqs": 6}
    plain = make_llm(folder, **kwargs)
    prompts = _prompts(3, seed=5)
    params = {"max_tokens": 30, "n": 2}
    expected = _token_ids(_generate(plain, prompts, **params))
    llm = _oracle_llm(folder, prompts, [o[0] for o in expected], **kwargs)
    assert _token_ids(_generate(llm, prompts, **params)) == expected
    assert llm.engine.scheduler.num_preemptions_total > 0
    stats = llm.engine.speculator.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_prefix_caching_hits_resume_exactly(folder):
    """A second pass over the same prompts (ngram drafts, some refused); a request extending a finished
    one's prompt and output starts from a snapshot taken inside a verify step (every draft accepted), past
    the prompt: the state of accepted tokens only, copied from its ring row."""
    plain, spec = _pair(folder, NGRAM)
    prompts = _echo_prompts(plain, 3, seed=7)
    expected = _token_ids(_generate(plain, prompts, max_tokens=28))
    for _ in range(2):
        assert _token_ids(_generate(spec, prompts, max_tokens=28)) == expected

    answers = [o[0] for o in expected]
    longer = [p + a for p, a in zip(prompts, answers, strict=True)]
    longer_answers = [o[0] for o in _token_ids(_generate(plain, longer, max_tokens=28))]
    oracle = _oracle_llm(folder, prompts + longer, answers + longer_answers)
    assert _token_ids(_generate(oracle, prompts, max_tokens=28)) == expected
    outputs = oracle.generate([{"prompt_token_ids": p} for p in longer], _greedy(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == longer_answers
    # the hit reaches the last block boundary before the longer prompt's last token, past the first
    # prompt: a snapshot some verify step left
    for prompt, request, output in zip(prompts, longer, outputs, strict=True):
        assert output.num_cached_tokens == (len(request) - 1) // 8 * 8 > len(prompt)
    stats = oracle.engine.speculator.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    for llm in (spec, oracle):  # every snapshot slot reserved by a verify step was kept or given back
        snapshots = llm.engine.kv_manager.snapshots
        assert snapshots.num_free + len(snapshots.by_hash) == snapshots.count


def _snapshot_ends(manager, tokens: list[int]) -> list[int]:
    """The block boundaries of `tokens` whose state snapshot is findable."""
    ends, block_hash = [], None
    for end in range(8, len(tokens) + 1, 8):
        block_hash = hash_block(block_hash, tokens[end - 8 : end])
        if block_hash in manager.snapshots.by_hash:
            ends.append(end)
    return ends


def test_verify_steps_crossing_a_boundary_each_keep_its_snapshot(folder):
    """k = 7 and blocks of 8: every verify step (all drafts accepted) crosses a block boundary, so each
    step copies the last one's snapshot while reserving its own. A request's newest decode snapshot is at
    its last boundary, or the one before where its last verify step crossed that one (the copy is made
    by the request's next step, which a finished request has not); no snapshot slot is lost; a next
    turn's output is exact."""
    plain = make_llm(folder)
    prompts = _prompts(2, seed=10)
    answers = [o[0] for o in _token_ids(_generate(plain, prompts, max_tokens=40))]
    longer = [p + a for p, a in zip(prompts, answers, strict=True)]
    longer_answers = [o[0] for o in _token_ids(_generate(plain, longer, max_tokens=8))]
    oracle = _oracle_llm(folder, prompts + longer, answers + longer_answers, k=7)
    assert [o[0] for o in _token_ids(_generate(oracle, prompts, max_tokens=40))] == answers
    manager = oracle.engine.kv_manager
    for prompt, tokens in zip(prompts, longer, strict=True):
        last = (len(tokens) - 1) // 8 * 8  # the last boundary computed (the last token never is)
        decode_ends = [end for end in _snapshot_ends(manager, tokens) if end > len(prompt)]
        # the newest decode snapshot is kept (older ones go first when slots run short)
        assert decode_ends and decode_ends[-1] >= last - 8
    snapshots = manager.snapshots
    assert snapshots.num_free + len(snapshots.by_hash) == snapshots.count
    outputs = oracle.generate([{"prompt_token_ids": p} for p in longer], _greedy(8), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == longer_answers


def test_draft_model_greedy_equals_without_speculation(folder, tmp_path):
    """A draft model of the same vocabulary without recurrent layers (a tiny Llama) drafting for the
    hybrid target."""
    draft = _save_draft(tmp_path / "draft", "LlamaForCausalLM", seed=21, num_hidden_layers=1)
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}
    prompts = _prompts(3, seed=8)
    plain, spec = _pair(folder, config)
    assert _token_ids(_generate(spec, prompts)) == _token_ids(_generate(plain, prompts))
    assert spec.engine.speculator.stats.num_draft_tokens > 0


def test_sampling_keeps_the_target_distribution(folder):
    """Seeded samples of the first output tokens with and without speculation (the oracle drafts the
    greedy path, accepted only where the sample agrees): one distribution by a chi-square test, told
    apart from a wrong one."""
    prompt = _prompts(1, seed=6)[0]
    plain = make_llm(folder, max_num_seqs=64)
    greedy = _token_ids(_generate(plain, [prompt], max_tokens=4))[0][0]
    llm = _oracle_llm(folder, [prompt], [greedy], max_num_seqs=64)
    params = {"temperature": 1.0, "top_k": 3, "max_tokens": 4, "n": 400}
    plain_paths = Counter(tuple(c[1:4]) for c in _token_ids(_generate(plain, [prompt], seed=11, **params))[0])
    spec_paths = Counter(tuple(c[1:4]) for c in _token_ids(_generate(llm, [prompt], seed=12, **params))[0])
    stats = llm.engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert _chi_square_p_value(plain_paths, spec_paths) > 1e-3
    assert _chi_square_p_value(plain_paths, Counter({tuple(greedy[1:4]): 400})) < 1e-6


def test_tensor_parallel_2_equals_1(folder):
    """Two ranks (gloo), each with its heads' states: the first rank places the rows, the other runs the
    same chains from the step's inputs."""
    plain = make_llm(folder)
    prompts = _echo_prompts(plain, 2, seed=0)
    expected = _token_ids(_generate(plain, prompts))
    two = make_llm(folder, speculative_config=NGRAM, tensor_parallel_size=2)
    try:
        assert _token_ids(_generate(two, prompts)) == expected
        stats = two.engine.speculator.stats
    finally:
        two.engine.shutdown()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
