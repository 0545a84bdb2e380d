"""EAGLE-3 speculation (method eagle3) on the CUDA engine, CUDA graphs on for the target (the head's steps
run eagerly): a random Llama-3.1-8B-shaped target of 6 layers and a random EAGLE-3 head of the released
format written here (bf16 safetensors, d2t over a 32,000-id draft vocabulary). Greedy output against the
same engine without it, where bf16 noise allows; the hidden states the graphs replay into the head's
buffer are those an eager run computes (run on the GPU machine)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.gpu.test_engine_gpu import (
    _first_divergence_is_a_near_tie,
    _greedy,
    _llm,
    _save_random_model,
)
from tests.paths import MODELS_DIR

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

K = 3
DRAFT_VOCAB = 32000


def _save_head(folder, target_config: dict):
    """A random EAGLE-3 head for `target_config` in the released format (no embedding: the target's)."""
    from safetensors.torch import save_file

    hidden = target_config["hidden_size"]
    heads, kv_heads = target_config["num_attention_heads"], target_config["num_key_value_heads"]
    head_dim = target_config.get("head_dim") or hidden // heads
    inter = target_config["intermediate_size"]
    vocab = target_config["vocab_size"]
    config = {
        **{k: v for k, v in target_config.items() if k not in ("architectures", "num_hidden_layers")},
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "draft_vocab_size": DRAFT_VOCAB,
        "tie_word_embeddings": False,
    }
    g = torch.Generator().manual_seed(5)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * 0.05).to(torch.bfloat16)

    ids = torch.randperm(vocab, generator=g)[:DRAFT_VOCAB].sort().values
    tensors = {
        "midlayer.self_attn.q_proj.weight": matrix(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": matrix(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": matrix(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": matrix(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": matrix(inter, hidden),
        "midlayer.mlp.up_proj.weight": matrix(inter, hidden),
        "midlayer.mlp.down_proj.weight": matrix(hidden, inter),
        "midlayer.hidden_norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "midlayer.input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "fc.weight": matrix(hidden, 3 * hidden),
        "norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": matrix(DRAFT_VOCAB, hidden),
        "d2t": ids - torch.arange(DRAFT_VOCAB),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True),
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    target = _save_random_model("llama-3.1-8b", tmp_path_factory.mktemp("eagle3_target"), num_layers=6)
    config = json.loads((MODELS_DIR / "llama-3.1-8b" / "config.json").read_text())
    head = _save_head(tmp_path_factory.mktemp("eagle3_head") / "head", config)
    return target, head


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 40000 + 100 for j in range(40 + 9 * i)] for i in range(n)]


def _spec(head, k: int = K) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}


def _free(llm) -> None:
    llm.engine.shutdown()
    del llm
    torch.cuda.empty_cache()


def test_eagle3_follows_the_plain_engine_with_graphs(folders):
    target, head = folders
    prompts = _prompts(6)
    plain_llm = _llm(target)
    plain = _greedy(plain_llm, prompts, 96)
    _free(plain_llm)
    llm = _llm(target, speculative_config=_spec(head))
    assert llm.engine.executor.runner.graph_runner is not None  # the target replays its graphs
    got = _greedy(llm, prompts, 96)
    drafter = llm.engine.speculator.draft
    assert llm.engine.speculator.stats.num_draft_tokens > 0
    assert drafter.checkpoint.aux_layer_ids == (2, 3, 3)  # vLLM's default for a 6-layer Llama
    _first_divergence_is_a_near_tie(got, plain)
    engine = llm.engine
    assert drafter.kv_manager.pool.num_blocks == engine.memory_plan.num_kv_blocks
    assert engine.executor.runner.kv_bytes_per_block() == engine.memory_plan.block_bytes
    _free(llm)


def _streams(llm, prompts) -> tuple[dict[tuple[int, int], torch.Tensor], list[list[int]]]:
    """The hidden-state rows the head receives, by (prompt index, position; the last computed wins), and
    each prompt's output tokens. Speculation is off: plain decode steps, replayed from graphs if any."""
    from fitserve import SamplingParams

    drafter = llm.engine.speculator.draft
    rows_by_id: dict[tuple[str, int], torch.Tensor] = {}
    original = drafter.after_launch

    def spy(scheduler_output):
        torch.cuda.synchronize()
        rows = drafter.aux[: scheduler_output.num_batched_tokens].float().cpu()
        offset = 0
        for item in scheduler_output.scheduled:
            for j in range(item.num_new_tokens):
                rows_by_id[(item.request.request_id, item.start + j)] = rows[offset + j]
            offset += item.num_new_tokens
        original(scheduler_output)

    drafter.after_launch = spy
    llm.engine.speculator.wants_drafts = lambda running: False
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    index = {out.request_id: i for i, out in enumerate(outs)}
    seen = {}
    for (request_id, position), row in rows_by_id.items():
        parent = next((rid for rid in index if request_id == rid or request_id.startswith(f"{rid}-")), None)
        if parent is not None:
            seen[(index[parent], position)] = row
    return seen, [list(o.outputs[0].token_ids) for o in outs]


def test_graph_replays_write_the_hidden_states(folders):
    """Decode steps replayed from CUDA graphs hand the head the rows an eager run computes."""
    target, head = folders
    prompts = _prompts(2)
    graphs = _llm(target, speculative_config=_spec(head), enable_prefix_caching=False)
    with_graphs, graph_tokens = _streams(graphs, prompts)
    _free(graphs)
    eager = _llm(target, speculative_config=_spec(head), enable_prefix_caching=False, enforce_eager=True)
    without, eager_tokens = _streams(eager, prompts)
    _free(eager)
    checked = 0
    for i, prompt in enumerate(prompts):
        same = 0  # decode positions whose inputs agree: up to the first differing token
        while same < len(eager_tokens[i]) and graph_tokens[i][same] == eager_tokens[i][same]:
            same += 1
        # output token j is fed at position len(prompt) + j; the last one never is
        for position in range(len(prompt), len(prompt) + min(same, len(eager_tokens[i]) - 1)):
            row, other = without.get((i, position)), with_graphs.get((i, position))
            assert row is not None and other is not None, f"no row for position {position} of prompt {i}"
            scale = row.abs().max().item() + 1e-6
            assert (other - row).abs().max().item() < 0.05 * scale, f"position {position} of prompt {i}"
            checked += 1
    assert checked >= 10
