"""Steps with prompt tokens run as CUDA graph pieces around eager attention (worker/piecewise_graphs.py)."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.gpu.test_engine_gpu import (
    _first_divergence_is_a_near_tie,
    _greedy,
    _llm,
    _prompts,
    _save_random_model,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BLOCK = 16


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """After each test, hand its engine's memory back: the next modules' subprocesses count what this
    process still holds as taken by another process."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module", params=[("qwen3-0.6b", 4), ("llama-3.1-8b", 4)], ids=["qwen3", "llama"])
def model_folder(request, tmp_path_factory):
    shape, layers = request.param
    return _save_random_model(shape, tmp_path_factory.mktemp("piecewise_models"), layers)


def _step(context_lens: list[int], query_lens: list[int], first_block: int, vocab: int, seed: int):
    """Inputs of one step: sequence i has context_lens[i] tokens cached and query_lens[i] new ones, in
    its own run of blocks starting at first_block (blocks are handed out in order, 4 per sequence)."""
    from fitserve.layers.attention.metadata import AttentionMetadata

    generator = torch.Generator().manual_seed(seed)
    ids, positions, slots, tables = [], [], [], []
    for i, (cached, new) in enumerate(zip(context_lens, query_lens)):
        blocks = list(range(first_block + 4 * i, first_block + 4 * i + 4))
        tables.append(blocks)
        for position in range(cached, cached + new):
            positions.append(position)
            slots.append(blocks[position // BLOCK] * BLOCK + position % BLOCK)
        ids += torch.randint(vocab, (new,), generator=generator).tolist()
    starts = [0]
    for new in query_lens:
        starts.append(starts[-1] + new)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    cuda = {"device": "cuda"}
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, **cuda),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, **cuda),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, **cuda),
        block_tables=torch.tensor(tables, dtype=torch.int32, **cuda),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens,
    )
    return torch.tensor(ids, **cuda), torch.tensor(positions, **cuda), metadata


def _assert_near(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Within bf16 rounding of each other: the padded GEMMs may take other cuBLAS kernels than eager's."""
    error = (got.float() - expected.float()).norm() / expected.float().norm()
    assert error < 1e-2, f"{what}: relative error {error:.2e}"


def test_a_mixed_step_in_pieces_matches_the_eager_forward(model_folder):
    """Sequences with cached context decoding beside new prompts: the pieces give the eager forward's
    hidden states and cache writes, and write nothing outside the step's slots but the null block."""
    from fitserve.layers.attention.metadata import forward_context

    # a small cache, so that the test can keep copies of it
    llm = _llm(
        model_folder, max_num_batched_tokens=256, enable_prefix_caching=False, num_gpu_blocks_override=64
    )
    runner = llm.engine.executor.runner
    piecewise = runner.piecewise_runner
    assert piecewise is not None and piecewise.max_tokens == 256
    vocab = llm.engine.config.model.hf_config.vocab_size
    caches = runner.kv_caches
    # Step 1 (eager) fills the context of three sequences; step 2 decodes them beside two prompts.
    ids, positions, metadata = _step([0, 0, 0], [20, 37, 5], first_block=1, vocab=vocab, seed=1)
    with torch.inference_mode(), forward_context(metadata, caches):
        runner.model(ids, positions)
    context = [20, 37, 5, 0, 0]
    ids, positions, metadata = _step(context, [1, 1, 1, 30, 2], first_block=1, vocab=vocab, seed=2)
    assert piecewise.padded_size(ids.shape[0]) == 48  # 35 tokens, 13 rows of padding
    before = [cache.clone() for cache in caches]
    with torch.inference_mode(), forward_context(metadata, caches):
        eager = runner.model(ids, positions).clone()
    eager_caches = [cache.clone() for cache in caches]
    for cache, saved in zip(caches, before):
        cache.copy_(saved)
    steps_before = piecewise.steps_run
    with torch.inference_mode(), forward_context(metadata, caches):
        pieces = piecewise.run(ids, positions, metadata).clone()
    assert piecewise.steps_run == steps_before + 1
    _assert_near(pieces, eager, "hidden states")
    slots = metadata.slot_mapping
    for layer, (cache, eager_cache, saved) in enumerate(zip(caches, eager_caches, before)):
        flat, eager_flat, saved_flat = (c.flatten(1, 2) for c in (cache, eager_cache, saved))
        _assert_near(flat[:, slots], eager_flat[:, slots], f"layer {layer}'s cache writes")
        untouched = torch.ones(flat.shape[1], dtype=torch.bool, device="cuda")
        untouched[slots] = False
        untouched[:BLOCK] = False  # the null block takes the padding rows' writes
        assert torch.equal(flat[:, untouched], saved_flat[:, untouched]), "a write outside the step's slots"


def test_chunked_prefill_through_pieces_matches_eager(model_folder):
    """Chunks of at most 128 tokens beside decoding requests: every step with prompt tokens runs in
    pieces, and the greedy outputs leave eager mode's only at near-ties."""
    prompts = _prompts(8)
    chunked = {"max_num_batched_tokens": 128, "max_num_seqs": 8, "enable_prefix_caching": False}
    eager_llm = _llm(model_folder, enforce_eager=True, **chunked)
    assert eager_llm.engine.executor.runner.piecewise_runner is None
    eager = _greedy(eager_llm, prompts, 48)
    del eager_llm
    torch.cuda.empty_cache()
    llm = _llm(model_folder, **chunked)
    piecewise = llm.engine.executor.runner.piecewise_runner
    assert piecewise is not None and piecewise.max_tokens == 128
    got = _greedy(llm, prompts, 48)
    num_prompt_tokens = sum(map(len, prompts))
    assert piecewise.steps_run >= num_prompt_tokens // 128, "steps with prompt tokens did not run in pieces"
    _first_divergence_is_a_near_tie(got, eager)
    # The first token comes from the step that ends the prompt, which ran in pieces: its logprobs
    # match eager mode's to bf16 rounding.
    errors = [
        abs(ours.logprobs[0][token_id].logprob - entry.logprob)
        for ours, reference in zip(got, eager)
        for token_id, entry in reference.logprobs[0].items()
        if token_id in ours.logprobs[0]
    ]
    assert len(errors) >= 8 * 15, "the top-20 tokens of the first step hardly overlap"
    assert sum(errors) / len(errors) < 0.05 and max(errors) < 0.25, (
        f"first-token logprobs: mean error {sum(errors) / len(errors):.3f}, max {max(errors):.3f}"
    )
