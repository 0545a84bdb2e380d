"""draft_model and eagle3 speculation beside a tensor-parallel target on the CPU (gloo, one process per
rank): the drafter lives whole on rank 0 (single_rank), so TP 2 gives TP 1's greedy tokens without
speculation, and the same drafts and acceptance as TP 1 with it; what is not built is refused before any
weight loads."""

from __future__ import annotations

import math

import pytest
import torch

from fitserve.distributed import parallel_state
from tests.unit.test_engine_vs_hf import make_llm, save_tiny_model
from tests.unit.test_spec_decode_draft import _save_draft
from tests.unit.test_spec_decode_eagle3 import HIDDEN, VOCAB, _head_tensors, save_head
from tests.unit.test_spec_decode_engine import _generate, _prompts, _token_ids, record_drafts

K = 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    save_tiny_model(path, "LlamaForCausalLM")
    return path


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """A one-layer draft of another seed: some drafts accepted, some refused."""
    return _save_draft(tmp_path_factory.mktemp("draft"), "LlamaForCausalLM", seed=21, num_hidden_layers=1)


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """An EAGLE-3 head with its own embedding."""
    tensors = _head_tensors(7)
    g = torch.Generator().manual_seed(8)
    tensors["embed_tokens.weight"] = torch.randn(VOCAB, HIDDEN, generator=g) / math.sqrt(HIDDEN)
    return save_head(tmp_path_factory.mktemp("head"), tensors=tensors)


@pytest.fixture(scope="module")
def bare_head(tmp_path_factory):
    """An EAGLE-3 head without an embedding: it reads the target's (at TP 2 read whole from its weights)."""
    return save_head(tmp_path_factory.mktemp("bare_head"), seed=9)


def _run(folder, speculative_config, prompts, **kwargs):
    """(tokens, drafts proposed, accepted draft count) of one engine; shut down after."""
    llm = make_llm(folder, speculative_config=speculative_config, **kwargs)
    try:
        records = record_drafts(llm.engine.speculator.draft) if speculative_config else []
        tokens = _token_ids(_generate(llm, prompts, max_tokens=20))
        stats = llm.engine.speculator.stats if speculative_config else None
        return tokens, records, (stats.num_draft_tokens, stats.num_accepted_tokens) if stats else None
    finally:
        llm.engine.shutdown()


def _speculative(method: str, model) -> dict:
    return {"method": method, "model": str(model), "num_speculative_tokens": K}


@pytest.mark.parametrize(
    "drafter", ["draft_model-itself", "draft_model-random", "eagle3-own-embedding", "eagle3-target-embedding"]
)
def test_tp2_with_a_drafter_equals_tp1(folder, draft, head, bare_head, drafter):
    prompts = _prompts(3, seed=2)
    models = {
        "draft_model-itself": folder,  # the target as its own draft: every draft accepted
        "draft_model-random": draft,
        "eagle3-own-embedding": head,
        "eagle3-target-embedding": bare_head,
    }
    config = _speculative(drafter.split("-")[0], models[drafter])
    plain, _, _ = _run(folder, None, prompts)
    one, one_drafts, one_stats = _run(folder, config, prompts)
    two, two_drafts, two_stats = _run(folder, config, prompts, tensor_parallel_size=2)
    assert one == plain
    assert two == plain
    assert one_stats[0] > 0
    assert two_drafts == one_drafts
    assert two_stats == one_stats
    if drafter == "draft_model-itself":
        assert two_stats[1] == two_stats[0]


def test_single_rank_reports_one_rank_and_restores():
    state = parallel_state.TensorParallel(rank=1, size=2)
    stage = parallel_state.PipelineParallel(stage=1, size=2, tensor_parallel_size=2)
    parallel_state.set_tensor_parallel(state)
    parallel_state.set_pipeline_parallel(stage)
    try:
        with pytest.raises(RuntimeError), parallel_state.single_rank():
            assert (parallel_state.tp().rank, parallel_state.tp().size) == (0, 1)
            assert parallel_state.pp().size == 1
            raise RuntimeError("restored even so")
        assert parallel_state.tp() == state
        assert parallel_state.pp() == stage
    finally:
        parallel_state.forget_tensor_parallel()


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_a_split_drafter_is_refused_before_loading(folder, draft, head, method, monkeypatch):
    import fitserve.models.loader as loader
    import fitserve.worker.model_runner as model_runner

    loaded = []
    original = loader.load_model
    for module in (loader, model_runner):
        monkeypatch.setattr(module, "load_model", lambda *a, **k: loaded.append(1) or original(*a, **k))
    model = draft if method == "draft_model" else head
    config = {**_speculative(method, model), "draft_tensor_parallel_size": 2}
    match = (
        f"method {method} with draft_tensor_parallel_size 2 \\(target --tensor-parallel-size 2\\) is not "
        "built: .* set draft_tensor_parallel_size 1"
    )
    with pytest.raises(ValueError, match=match):
        make_llm(folder, speculative_config=config, tensor_parallel_size=2)
    assert not loaded


def test_the_plan_counts_the_whole_draft_on_each_rank(folder, draft):
    """The plan is one rank's, alike for every rank: the draft (whole on rank 0) is counted whole on it,
    as at TP 1, while the target's share halves."""
    from fitserve.args import EngineArgs
    from fitserve.planner.resolve import plan_settings

    base = {"model": str(folder), "device": "cpu", "dtype": "float32", "cpu_kv_cache_space": 0.01}
    added = {}
    for tp in (1, 2):
        plain = plan_settings(EngineArgs(**base, tensor_parallel_size=tp)).plan
        fit = plan_settings(
            EngineArgs(**base, tensor_parallel_size=tp, speculative_config=_speculative("draft_model", draft))
        ).plan
        added[tp] = (
            fit.kv_bytes_per_token - plain.kv_bytes_per_token,
            fit.estimated.weights - plain.estimated.weights,
        )
    assert added[1][0] > 0 and added[1][1] > 0
    assert added[2] == added[1]


def test_the_plan_counts_the_targets_embedding_read_for_a_bare_head(folder, bare_head):
    """At TP 2 a head without an embedding holds the target's whole on rank 0: counted in the plan."""
    from fitserve.args import EngineArgs
    from fitserve.planner.resolve import plan_settings

    base = {"model": str(folder), "device": "cpu", "dtype": "float32", "cpu_kv_cache_space": 0.01}
    added = {}
    for tp in (1, 2):
        plain = plan_settings(EngineArgs(**base, tensor_parallel_size=tp)).plan
        spec = _speculative("eagle3", bare_head)
        fit = plan_settings(EngineArgs(**base, tensor_parallel_size=tp, speculative_config=spec)).plan
        added[tp] = fit.estimated.weights - plain.estimated.weights
    assert added[2] - added[1] == VOCAB * HIDDEN * 4  # float32
