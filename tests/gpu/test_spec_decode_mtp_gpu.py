"""MTP speculation (method mtp) on the CUDA engine, CUDA graphs on for the target (the MTP layer's own steps
run eagerly), run on the GPU machine:

- a small random Qwen3.5 (head dims 128, as the released models), all full-attention and hybrid, with a
  random MTP layer written beside it (bf16 mtp.safetensors): greedy output against the same engine without
  MTP, where bf16 noise allows; the output rows the target's graphs replay into the MTP buffer are those an
  eager run computes;
- the field report's setup: Qwen3.6-27B-AWQ-INT4's shape (shared/models, dummy weights) with MTP at 3 and 4
  draft tokens: it starts, drafts, and the KV pool, block bytes and weights agree with the plan.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from tests.paths import MODELS_DIR, SMOLLM2_TOKENIZER_DIR

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

K = 3
CLEAR_MARGIN = 0.5  # as tests/gpu/test_engine_gpu.py: bf16 noise flips closer top-2 logits either way
FULL, LIN = "full_attention", "linear_attention"
LAYOUTS = {"full": [FULL] * 4, "hybrid": [LIN, LIN, FULL, LIN, LIN, FULL]}


def _mtp_tensors(text: dict, seed: int = 5) -> dict[str, torch.Tensor]:
    """A random MTP layer for the config values `text` (dense MLP), bf16, in the checkpoint's names."""
    g = torch.Generator().manual_seed(seed)
    hidden, inter = text["hidden_size"], text["intermediate_size"]
    heads, kv_heads, head_dim = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) / math.sqrt(cols)).to(torch.bfloat16)

    def norm(dim: int = hidden) -> torch.Tensor:
        return (0.2 * torch.randn(dim, generator=g)).to(torch.bfloat16)

    p = "mtp.layers.0."
    return {
        "mtp.fc.weight": matrix(hidden, 2 * hidden),
        "mtp.pre_fc_norm_embedding.weight": norm(),
        "mtp.pre_fc_norm_hidden.weight": norm(),
        "mtp.norm.weight": norm(),
        p + "input_layernorm.weight": norm(),
        p + "post_attention_layernorm.weight": norm(),
        p + "self_attn.q_proj.weight": matrix(2 * heads * head_dim, hidden),
        p + "self_attn.k_proj.weight": matrix(kv_heads * head_dim, hidden),
        p + "self_attn.v_proj.weight": matrix(kv_heads * head_dim, hidden),
        p + "self_attn.o_proj.weight": matrix(hidden, heads * head_dim),
        p + "self_attn.q_norm.weight": norm(head_dim),
        p + "self_attn.k_norm.weight": norm(head_dim),
        p + "mlp.gate_proj.weight": matrix(inter, hidden),
        p + "mlp.up_proj.weight": matrix(inter, hidden),
        p + "mlp.down_proj.weight": matrix(hidden, inter),
    }


@pytest.fixture(scope="module", params=list(LAYOUTS))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from tests.model_folders import save_with_tokenizer
    from tests.unit import qwen3_5_helpers as helpers

    layers = LAYOUTS[request.param]
    text = dict(helpers.TEXT, vocab_size=4096, hidden_size=256, intermediate_size=512)
    text.update(
        head_dim=128,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        max_position_embeddings=4096,
        num_hidden_layers=len(layers),
        layer_types=layers,
        mtp_num_hidden_layers=1,
    )
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[8, 4, 4])
    config = transformers.Qwen3_5TextConfig(**text)
    config.architectures = ["Qwen3_5ForCausalLM"]
    model = helpers.build_hf(config).to(torch.bfloat16)
    folder = save_with_tokenizer(model, tmp_path_factory.mktemp(f"qwen35-mtp-{request.param}"))
    save_file(_mtp_tensors(text), str(folder / "mtp.safetensors"))
    return request.param, folder


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4096) for _ in range(rng.randint(70, 300))] for _ in range(n)]


def _llm(folder: Path, **kwargs):
    from fitserve import LLM

    kwargs.setdefault("gpu_memory_utilization", 0.25)
    return LLM(str(folder), max_model_len=2048, max_num_seqs=8, **kwargs)


def _greedy(llm, prompts, max_tokens: int, logprobs: int | None = None):
    from fitserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    return [
        o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]


def assert_leaves_only_at_near_ties(got, plain) -> None:
    """Where a speculative run first leaves the plain run's tokens, the plain run's top-2 margin was a
    near-tie (bf16 sums in another order)."""
    for ours, ref in zip(got, plain):
        for step, (a, b) in enumerate(zip(ours.token_ids, ref.token_ids)):
            if a != b:
                values = sorted((e.logprob for e in ref.logprobs[step].values()), reverse=True)
                assert values[0] - values[1] < CLEAR_MARGIN, f"diverged at step {step}"
                break


def _free(llm) -> None:
    """Stops the engine and gives its GPU memory back (the caller must hold no other reference to it)."""
    import gc

    llm.engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_mtp_follows_the_plain_engine_with_graphs(checkpoint):
    _, folder = checkpoint
    prompts = _prompts(6)
    plain_llm = _llm(folder)
    plain = _greedy(plain_llm, prompts, 128, logprobs=5)
    _free(plain_llm)
    llm = _llm(folder, speculative_config={"method": "mtp", "num_speculative_tokens": K})
    engine = llm.engine
    assert engine.executor.runner.graph_runner is not None  # the target replays its graphs
    got = _greedy(llm, prompts, 128)
    assert engine.speculator.stats.num_draft_tokens > 0
    assert_leaves_only_at_near_ties(got, plain)
    drafter = engine.speculator.draft
    assert drafter.kv_manager.pool.num_blocks == engine.memory_plan.num_kv_blocks
    assert engine.executor.runner.kv_bytes_per_block() == engine.memory_plan.block_bytes
    _free(llm)


def _output_rows(folder: Path, prompts, **kwargs) -> dict[tuple[int, int], torch.Tensor]:
    """The output rows the MTP layer receives, by (prompt, position; the last computed wins), with
    speculation switched off (plain decode steps: replayed from graphs unless enforce_eager)."""
    llm = _llm(folder, speculative_config={"method": "mtp", "num_speculative_tokens": K}, **kwargs)
    speculator = llm.engine.speculator
    speculator.wants_drafts = lambda running: False
    drafter = speculator.draft
    index = {}
    rows: dict[tuple[int, int], torch.Tensor] = {}
    original = drafter.after_launch

    def spy(scheduler_output):
        step = drafter.aux[: scheduler_output.num_batched_tokens].float().cpu()
        offset = 0
        for item in scheduler_output.scheduled:
            which = index.setdefault(item.request.request_id, len(index))
            for j in range(item.num_new_tokens):
                rows[(which, item.start + j)] = step[offset + j]
            offset += item.num_new_tokens
        original(scheduler_output)

    drafter.after_launch = spy
    _greedy(llm, prompts, 24)
    speculator = drafter = original = None  # the engine's other references here, so _free frees it
    _free(llm)
    return rows


def test_graphs_replay_the_output_rows_an_eager_run_keeps(checkpoint):
    _, folder = checkpoint
    prompts = _prompts(2)
    graphs = _output_rows(folder, prompts)
    eager = _output_rows(folder, prompts, enforce_eager=True)
    assert graphs.keys() == eager.keys()
    for key, row in graphs.items():
        torch.testing.assert_close(row, eager[key], atol=0.05, rtol=0.05, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("k", [3, 4])
def test_qwen36_27b_awq_int4_with_mtp_starts_drafts_and_matches_its_plan(k):
    """The field report's setup, dummy weights (so acceptance is meaningless): MTP k = 3 and 4 on the
    Qwen3.6-27B-AWQ-INT4 shape."""
    from fitserve import LLM

    llm = LLM(
        str(MODELS_DIR / "qwen3.6-27b-awq-int4"),
        tokenizer=str(SMOLLM2_TOKENIZER_DIR),
        load_format="dummy",
        max_model_len=4096,
        gpu_memory_utilization=0.85,
        speculative_config={"method": "mtp", "num_speculative_tokens": k},
    )
    engine = llm.engine
    drafter = engine.speculator.draft
    predictor = drafter.predictor
    from fitserve.layers.linear import UnquantizedLinearMethod

    # the ignore list's re:.*mtp.* leaves the layer in bf16
    assert isinstance(predictor.layers[0].self_attn.q_proj.linear_method, UnquantizedLinearMethod)
    _greedy(llm, _prompts(4), 64)
    assert engine.speculator.stats.num_draft_tokens > 0
    assert drafter.kv_manager.pool.num_blocks == engine.memory_plan.num_kv_blocks
    assert engine.executor.runner.kv_bytes_per_block() == engine.memory_plan.block_bytes
    assert drafter.kv_bytes_per_token == 2 * 4 * 256 * 2  # one full layer: 4 KV heads of 256, bf16
    _free(llm)
