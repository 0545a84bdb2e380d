"""MTP speculation (method mtp) on tiny random Qwen3.5 checkpoints (CPU) that carry `mtp.*` tensors written by
the test: the MTP layer's forward against a plain torch reimplementation of its definition; greedy output
with mtp identical to without; drafts through the engine equal MTP computed from scratch on HF's hidden
states; an MTP layer built to predict well is accepted; bad inputs refused before loading; the plan counts
the layer. The targets are all full_attention (no recurrent state); the hybrid test runs once speculation
on hybrids is built."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from fitserve.args import EngineArgs
from fitserve.planner.resolve import plan_settings
from tests.model_folders import save_with_tokenizer
from tests.unit.qwen3_5_helpers import FULL, LIN, MOE, TEXT, build_hf
from tests.unit.test_engine_vs_hf import make_llm
from tests.unit.test_spec_decode_engine import (
    _generate,
    _prompts,
    _token_ids,
    each_engine_setting,
    record_drafts,
)

K = 3
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = TEXT["hidden_size"], 4, 2, 16
INTERMEDIATE, VOCAB, EPS = TEXT["intermediate_size"], TEXT["vocab_size"], TEXT["rms_norm_eps"]
ROTARY = HEAD_DIM // 4  # partial_rotary_factor 0.25


def _text_config(layer_types: list[str], mtp_layers: int = 1):
    values = {**TEXT, "layer_types": layer_types, "num_hidden_layers": len(layer_types)}
    config = transformers.Qwen3_5TextConfig(**values, mtp_num_hidden_layers=mtp_layers)
    config.architectures = ["Qwen3_5ForCausalLM"]
    return config


def mtp_tensors(
    seed: int, hidden: int = HIDDEN, intermediate: int = INTERMEDIATE, moe: bool = False
) -> dict[str, torch.Tensor]:
    """A random MTP layer in the checkpoint's names (norm offsets around 0, matrices std 1/sqrt(fan_in));
    `moe`: the MoE block of qwen3_5_helpers.MOE, experts in the per-expert form."""
    g = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) / math.sqrt(cols)

    def norm(dim: int = hidden) -> torch.Tensor:
        return 0.2 * torch.randn(dim, generator=g)

    layer = "mtp.layers.0."
    tensors = {
        "mtp.fc.weight": matrix(hidden, 2 * hidden),
        "mtp.pre_fc_norm_embedding.weight": norm(),
        "mtp.pre_fc_norm_hidden.weight": norm(),
        "mtp.norm.weight": norm(),
        layer + "input_layernorm.weight": norm(),
        layer + "post_attention_layernorm.weight": norm(),
        layer + "self_attn.q_proj.weight": matrix(2 * HEADS * HEAD_DIM, hidden),
        layer + "self_attn.k_proj.weight": matrix(KV_HEADS * HEAD_DIM, hidden),
        layer + "self_attn.v_proj.weight": matrix(KV_HEADS * HEAD_DIM, hidden),
        layer + "self_attn.o_proj.weight": matrix(hidden, HEADS * HEAD_DIM),
        layer + "self_attn.q_norm.weight": norm(HEAD_DIM),
        layer + "self_attn.k_norm.weight": norm(HEAD_DIM),
    }
    mlps = {"mlp.": intermediate}
    if moe:
        width, shared = MOE["moe_intermediate_size"], MOE["shared_expert_intermediate_size"]
        mlps = {f"mlp.experts.{e}.": width for e in range(MOE["num_experts"])}
        mlps["mlp.shared_expert."] = shared
        tensors[layer + "mlp.gate.weight"] = matrix(MOE["num_experts"], hidden)
        tensors[layer + "mlp.shared_expert_gate.weight"] = matrix(1, hidden)
    for mlp, width in mlps.items():
        tensors[layer + mlp + "gate_proj.weight"] = matrix(width, hidden)
        tensors[layer + mlp + "up_proj.weight"] = matrix(width, hidden)
        tensors[layer + mlp + "down_proj.weight"] = matrix(hidden, width)
    return tensors


def copying_mtp_tensors() -> dict[str, torch.Tensor]:
    """An MTP layer that passes the next token's normed embedding through (fc takes the embedding half,
    the layer adds nothing): with a target that does the same, its draft is the target's next token."""
    tensors = {name: torch.zeros_like(t) for name, t in mtp_tensors(0).items()}
    tensors["mtp.fc.weight"] = torch.cat([torch.eye(HIDDEN), torch.zeros(HIDDEN, HIDDEN)], dim=1)
    return tensors


def save_target(
    folder: Path, layer_types: list[str], tensors: dict | None, mtp_layers: int = 1, seed: int = 3
):
    """HF's tiny Qwen3.5 saved as a checkpoint, the MTP tensors beside it in mtp.safetensors."""
    model = build_hf(_text_config(layer_types, mtp_layers), seed=seed)
    save_with_tokenizer(model, folder)
    if tensors is not None:
        save_file(tensors, str(folder / "mtp.safetensors"))
    return folder, model


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_target(tmp_path_factory.mktemp("mtp-target"), [FULL, FULL], mtp_tensors(7))


def _mtp(k: int = K, method: str = "mtp") -> dict:
    return {"method": method, "num_speculative_tokens": k}


# ---- the layer against its definition -------------------------------------------------------------
def _rms(x: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + offset)


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first ROTARY dims of each head, theta 10000."""
    inv = 1.0 / 10000.0 ** (torch.arange(0, ROTARY, 2, dtype=torch.float32) / ROTARY)
    angles = positions[:, None].float() * inv[None]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    rotated, passed = x[..., :ROTARY], x[..., ROTARY:]
    a, b = rotated[..., : ROTARY // 2], rotated[..., ROTARY // 2 :]
    return torch.cat([rotated * cos + torch.cat([-b, a], -1) * sin, passed], -1)


def reference_mtp(
    t: dict, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The MTP layer over one causal sequence of rows, written from its definition: fc over the normed
    [embedding | hidden], one gated full-attention layer with its MLP, the final norm."""
    n = embeds.shape[0]
    x = torch.cat(
        [
            _rms(embeds, t["mtp.pre_fc_norm_embedding.weight"]),
            _rms(hidden, t["mtp.pre_fc_norm_hidden.weight"]),
        ],
        -1,
    )
    x = x @ t["mtp.fc.weight"].T
    p = "mtp.layers.0."
    h = _rms(x, t[p + "input_layernorm.weight"])
    qg = (h @ t[p + "self_attn.q_proj.weight"].T).view(n, HEADS, 2 * HEAD_DIM)
    q, gate = qg[..., :HEAD_DIM], qg[..., HEAD_DIM:]
    q = _rope(_rms(q, t[p + "self_attn.q_norm.weight"]), positions)
    k = (h @ t[p + "self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    k = _rope(_rms(k, t[p + "self_attn.k_norm.weight"]), positions)
    v = (h @ t[p + "self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
    x = x + (attn * torch.sigmoid(gate.reshape(n, -1))) @ t[p + "self_attn.o_proj.weight"].T
    m = _rms(x, t[p + "post_attention_layernorm.weight"])
    if p + "mlp.gate.weight" not in t:
        return _rms(x + _mlp(t, p + "mlp.", m), t["mtp.norm.weight"])
    # MoE: softmax router over all experts, the top k renormalised, plus the gated shared expert
    weights, ids = torch.topk((m @ t[p + "mlp.gate.weight"].T).softmax(-1), MOE["num_experts_per_tok"], -1)
    weights = weights / weights.sum(-1, keepdim=True)
    routed = torch.zeros_like(m)
    for row in range(n):
        for weight, expert in zip(weights[row], ids[row].tolist()):
            routed[row] += weight * _mlp(t, f"{p}mlp.experts.{expert}.", m[row])
    shared = torch.sigmoid(m @ t[p + "mlp.shared_expert_gate.weight"].T) * _mlp(
        t, p + "mlp.shared_expert.", m
    )
    return _rms(x + routed + shared, t["mtp.norm.weight"])


def _mlp(t: dict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    gate, up = x @ t[prefix + "gate_proj.weight"].T, x @ t[prefix + "up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ t[prefix + "down_proj.weight"].T


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_the_layer_computes_its_definition(moe):
    from fitserve.layers.attention.metadata import forward_context
    from fitserve.models.checkpoint_config import CheckpointConfig
    from fitserve.models.qwen3_5_config import qwen3_5_values
    from fitserve.models.qwen3_5_mtp import Qwen3_5MultiTokenPredictor

    values = qwen3_5_values(_text_config([LIN, FULL]).to_dict())
    config = CheckpointConfig({**values, **(MOE if moe else {})})
    tensors = mtp_tensors(11, moe=moe)
    with torch.device("cpu"):
        predictor = Qwen3_5MultiTokenPredictor(config)
    loaded = predictor.load_weights(iter(tensors.items()))
    assert loaded == {name for name, _ in predictor.named_parameters()}
    g = torch.Generator().manual_seed(2)
    embeds, hidden = torch.randn(9, HIDDEN, generator=g), torch.randn(9, HIDDEN, generator=g)
    positions = torch.arange(5, 14)
    with torch.no_grad(), forward_context(None, []):  # no cache: the rows attend as one sequence
        got = predictor(embeds, hidden, positions)
    torch.testing.assert_close(got, reference_mtp(tensors, embeds, hidden, positions), atol=1e-5, rtol=1e-5)


# ---- through the engine ------------------------------------------------------------------------------
@each_engine_setting
def test_greedy_output_equals_no_speculation(target, llm_kwargs):
    folder, _ = target
    prompts = _prompts(4, seed=1)
    plain = make_llm(folder, speculative_config={}, **llm_kwargs)  # '{}': auto-MTP off
    spec = make_llm(folder, speculative_config=_mtp(), **llm_kwargs)
    expected = _token_ids(_generate(plain, prompts, max_tokens=30))
    assert _token_ids(_generate(spec, prompts, max_tokens=30)) == expected
    assert spec.engine.speculator.stats.num_draft_tokens > 0
    # again: prompts found in the target's prefix cache (the layer reads zeros there): still exact
    assert _token_ids(_generate(spec, prompts, max_tokens=30)) == expected


def _hf_output_hidden(hf_model, tokens: list[int]) -> torch.Tensor:
    """HF's output hidden states (after the final norm) at every position: [N, hidden]."""
    with torch.no_grad():
        return hf_model.model(torch.tensor([tokens])).last_hidden_state[0].float()


def reference_drafts(tensors: dict, hf_model, tokens: list[int], k: int) -> list[int]:
    """MTP's drafts computed with no cache: row p reads (token p + 1, HF's output at p); each draft is the
    LM head's argmax at the last row, fed back with the layer's own output as its hidden."""
    embed = hf_model.model.embed_tokens.weight.detach()
    lm_head = hf_model.lm_head.weight.detach()
    hidden = list(_hf_output_hidden(hf_model, tokens)[:-1])
    row_tokens = list(tokens[1:])
    drafts = []
    for _ in range(k):
        out = reference_mtp(
            tensors, embed[torch.tensor(row_tokens)], torch.stack(hidden), torch.arange(len(row_tokens))
        )
        token = int((out[-1] @ lm_head.T).argmax())
        drafts.append(token)
        row_tokens.append(token)
        hidden.append(out[-1])
    return drafts


def test_engine_drafts_equal_the_reference(target, monkeypatch):
    """Through the engine (chunked prefill, verify steps, refused drafts, steps without drafts), each
    draft equals MTP computed from scratch on the request's tokens then."""
    folder, hf_model = target
    llm = make_llm(
        folder,
        speculative_config=_mtp(),
        enable_prefix_caching=False,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    speculator = llm.engine.speculator
    drafter = speculator.draft
    wants, calls = speculator.wants_drafts, []

    def some(running):
        calls.append(1)
        return len(calls) % 3 != 0 and wants(running)

    speculator.wants_drafts = some
    records = record_drafts(drafter)
    _generate(llm, _prompts(3, seed=13), max_tokens=16)
    assert len(records) >= 5
    tensors = mtp_tensors(7)
    for tokens, drafts in records:
        assert drafts == reference_drafts(tensors, hf_model, tokens, K)[: len(drafts)]


@pytest.fixture(scope="module")
def copying_target(tmp_path_factory):
    return write_copying_target(tmp_path_factory.mktemp("mtp-copying"))


def write_copying_target(folder: Path) -> Path:
    """A target whose layers add nothing (o_proj and down_proj zero: its next token is a function of the
    last one), with the copying MTP layer: the drafts should be the target's tokens."""
    model = build_hf(_text_config([FULL, FULL]), seed=4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")) or name == "model.norm.weight":
                param.zero_()
    save_with_tokenizer(model, folder)
    save_file(copying_mtp_tensors(), str(folder / "mtp.safetensors"))
    return folder


def test_a_layer_that_predicts_well_is_accepted(copying_target):
    prompts = _prompts(3, seed=2)
    plain = make_llm(copying_target, speculative_config={})
    spec = make_llm(copying_target, speculative_config=_mtp(k=4))
    expected = _token_ids(_generate(plain, prompts, max_tokens=24))
    assert _token_ids(_generate(spec, prompts, max_tokens=24)) == expected
    stats = spec.engine.speculator.stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.9


@pytest.mark.parametrize("method", ["qwen3_next_mtp", "deepseek_mtp"])
def test_vllms_other_names_run_as_mtp(method):
    from fitserve.spec_decode.config import parse_speculative_config

    config = parse_speculative_config(_mtp(method=method))
    assert config.method == "mtp" and config.num_speculative_tokens == K
    assert "mtp" in config.describe()


# ---- refusals ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bad_targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp-bad")
    no_fc = {k: v for k, v in mtp_tensors(1).items() if not k.startswith("mtp.fc.")}
    return {
        "no-layers": save_target(root / "no-layers", [FULL, FULL], None, mtp_layers=0)[0],
        "no-tensors": save_target(root / "no-tensors", [FULL, FULL], None)[0],
        "no-fc": save_target(root / "no-fc", [FULL, FULL], no_fc)[0],
        "two-layers": save_target(root / "two-layers", [FULL, FULL], mtp_tensors(1), mtp_layers=2)[0],
    }


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [
        ("no-layers", {}, "has no MTP layers \\(config.json mtp_num_hidden_layers is 0"),
        ("no-tensors", {}, "have no mtp.fc, mtp.pre_fc_norm_embedding.weight.*mtp_num_hidden_layers 1"),
        ("no-fc", {}, "have no mtp.fc tensors"),
        ("two-layers", {}, "has 2 MTP layers .*fitserve runs checkpoints of 1"),
        ("no-fc", {"tensor_parallel_size": 2}, "have no mtp.fc tensors"),  # checked before the ranks start
    ],
)
def test_bad_targets_are_refused_before_loading(bad_targets, name, kwargs, match, monkeypatch):
    import fitserve.spec_decode.mtp as mtp

    built = []
    monkeypatch.setattr(mtp.MtpDrafter, "__init__", lambda *a, **k: built.append(1))
    with pytest.raises(ValueError, match=match):
        make_llm(bad_targets[name], speculative_config=_mtp(), **kwargs)
    assert not built


def test_a_model_without_mtp_layers_of_another_family_is_refused(tmp_path):
    from tests.unit.test_engine_vs_hf import save_tiny_model

    save_tiny_model(tmp_path, "LlamaForCausalLM")
    match = "method mtp \\(the checkpoint's own MTP layers\\) on .*LlamaForCausalLM.*is not built.*Qwen3.5"
    with pytest.raises(ValueError, match=match):
        make_llm(tmp_path, speculative_config=_mtp())


def test_too_many_draft_tokens_are_refused():
    from fitserve.spec_decode.config import MAX_MTP_SPECULATIVE_TOKENS, parse_speculative_config

    limit = MAX_MTP_SPECULATIVE_TOKENS
    assert parse_speculative_config(_mtp(k=limit)).num_speculative_tokens == limit
    with pytest.raises(ValueError, match=f"num_speculative_tokens is {limit + 1}, above method mtp's limit"):
        parse_speculative_config(_mtp(k=limit + 1))


# ---- the plan ---------------------------------------------------------------------------------------
def test_the_plan_counts_the_layer_as_the_engine_does(target):
    folder, _ = target
    base = {"model": str(folder), "device": "cpu", "dtype": "float32", "cpu_kv_cache_space": 0.01}
    plain = plan_settings(EngineArgs(**base, speculative_config={})).plan  # '{}': auto-MTP off
    plan = plan_settings(EngineArgs(**base, speculative_config=_mtp())).plan
    assert plan.kv_bytes_per_token == plain.kv_bytes_per_token + 2 * KV_HEADS * HEAD_DIM * 4
    llm = make_llm(folder, speculative_config=_mtp())
    drafter = llm.engine.speculator.draft
    assert drafter.kv_bytes_per_token == 2 * KV_HEADS * HEAD_DIM * 4
    from fitserve.planner.draft_plan import mtp_footprint
    from fitserve.planner.engine_plan import inputs_from_engine_config

    assert plan.estimated.weights > plain.estimated.weights
    inputs = inputs_from_engine_config(llm.engine.config, plan.inputs.device)
    assert mtp_footprint(inputs, K).weight_bytes == drafter.weight_bytes


# ---- hybrid targets ---------------------------------------------------------------------------------
def test_hybrid_greedy_output_equals_no_speculation(tmp_path):
    folder, _ = save_target(tmp_path, [LIN, LIN, FULL, LIN], mtp_tensors(5))
    prompts = _prompts(3, seed=9)
    expected = _token_ids(_generate(make_llm(folder, speculative_config={}), prompts, max_tokens=20))
    spec = make_llm(folder, speculative_config=_mtp())
    assert _token_ids(_generate(spec, prompts, max_tokens=20)) == expected
    assert spec.engine.speculator.stats.num_draft_tokens > 0


# ---- auto-MTP ---------------------------------------------------------------------------------------
def _auto(folder, speculative_config=None, **kwargs):
    from fitserve.models.loader import load_hf_config
    from fitserve.planner.draft_plan import auto_mtp

    return auto_mtp(speculative_config, load_hf_config(str(folder)), str(folder), **kwargs)


def test_auto_mtp_turns_on_for_a_checkpoint_with_an_mtp_layer(target):
    from fitserve.planner.draft_plan import AUTO_MTP_TOKENS

    folder, _ = target
    auto = _auto(folder)
    assert auto.config == {"method": "mtp", "num_speculative_tokens": AUTO_MTP_TOKENS}
    assert "has an MTP layer" in auto.reason and "--speculative-config '{}' turns it off" in auto.reason
    choice = auto.choice()
    assert (choice.setting, choice.value, choice.explicit) == ("speculative_config", "mtp", False)
    # the config it picks runs: greedy output as without
    prompts = _prompts(2, seed=4)
    expected = _token_ids(_generate(make_llm(folder, speculative_config={}), prompts, max_tokens=12))
    spec = make_llm(folder, speculative_config=auto.config)
    assert _token_ids(_generate(spec, prompts, max_tokens=12)) == expected


@pytest.mark.parametrize(
    "given", [{}, {"method": "ngram", "num_speculative_tokens": 2}], ids=["off", "ngram"]
)
def test_auto_mtp_leaves_a_given_config_alone(target, given):
    assert _auto(target[0], given) is None


def test_auto_mtp_stays_off_where_mtp_cannot_run(target, bad_targets):
    folder, _ = target
    for kwargs, why in [
        ({"pipeline_parallel_size": 2}, "does not run with pipeline parallel"),
        ({"load_format": "dummy"}, "dummy weights"),
    ]:
        auto = _auto(folder, **kwargs)
        assert auto.config is None and why in auto.reason and auto.choice().value == "off"
    stripped = _auto(bad_targets["no-tensors"])
    assert stripped.config is None and "the weights have no mtp.fc" in stripped.reason
    assert _auto(bad_targets["no-layers"]) is None  # no MTP layer: nothing to decide
    # tensor parallel runs it (each rank its share of the layer: test_spec_decode_mtp_tp.py)
    assert _auto(folder, tensor_parallel_size=2).config is not None


def test_auto_mtp_turns_on_for_a_hybrid(tmp_path):
    folder, _ = save_target(tmp_path, [LIN, LIN, FULL, LIN], mtp_tensors(5))
    assert _auto(folder).config is not None


# ---- a quantized target -----------------------------------------------------------------------------
def test_a_quantized_target_drafts_with_its_16_bit_mtp_layer(tmp_path):
    """An int4 (compressed-tensors) target whose ignore list leaves the MTP layer in 16 bits, as the
    Qwen3.6-27B AWQ-INT4 export does: the layer builds unquantized, drafts, and the output is unchanged."""
    from fitserve.layers.linear import UnquantizedLinearMethod
    from tests.quant_checkpoints import QuantSpec
    from tests.unit.qwen3_5_quant_helpers import SIZES, build_model, write_int4

    model = build_model(False, seed=2, layer_types=[FULL, FULL], num_hidden_layers=2, mtp_num_hidden_layers=1)
    write_int4(tmp_path, model, QuantSpec("ct", 32, ignore=("re:.*mtp.*",)))
    hidden, width = SIZES["hidden_size"], SIZES["intermediate_size"]
    save_file(mtp_tensors(3, hidden=hidden, intermediate=width), str(tmp_path / "mtp.safetensors"))
    prompts = _prompts(2, seed=7)
    plain = make_llm(tmp_path, speculative_config={})
    spec = make_llm(tmp_path, speculative_config=_mtp())
    expected = _token_ids(_generate(plain, prompts, max_tokens=16))
    assert _token_ids(_generate(spec, prompts, max_tokens=16)) == expected
    assert spec.engine.speculator.stats.num_draft_tokens > 0
    predictor = spec.engine.speculator.draft.predictor
    for linear in (predictor.fc, predictor.layers[0].self_attn.q_proj, predictor.layers[0].mlp.down_proj):
        assert isinstance(linear.linear_method, UnquantizedLinearMethod)
    target_layer = spec.engine.executor.runner.model.model.layers[0]
    assert not isinstance(target_layer.self_attn.q_proj.linear_method, UnquantizedLinearMethod)


def test_an_mtp_layer_stored_int4_loads_quantized_and_drafts_as_its_dequantized_weights(tmp_path):
    """An export that quantizes the MTP layer too (no mtp entry in the ignore list, packed mtp.* tensors):
    the layer's linears take the int4 method under their mtp.* names, and the drafts through the engine
    equal MTP computed from scratch with the dequantized weights on the dequantized target."""
    from fitserve.layers.linear import UnquantizedLinearMethod
    from tests import quant_checkpoints
    from tests.quant_checkpoints import QuantSpec
    from tests.unit.qwen3_5_quant_helpers import SIZES, build_model, write_int4

    model = build_model(False, seed=2, layer_types=[FULL, FULL], num_hidden_layers=2, mtp_num_hidden_layers=1)
    spec = QuantSpec("ct", 32)
    checkpoint = write_int4(tmp_path, model, spec)
    floats = mtp_tensors(3, hidden=SIZES["hidden_size"], intermediate=SIZES["intermediate_size"])
    stored, dequantized = {}, dict(floats)
    for seed, (name, weight) in enumerate(sorted(floats.items())):
        if weight.ndim != 2:  # norms stay as they are
            stored[name] = weight
            continue
        rounded = quant_checkpoints.round_to_int4(weight, spec, seed=seed)
        module = name.removesuffix(".weight")
        for suffix, value in quant_checkpoints.pack_tensors(rounded, spec).items():
            stored[f"{module}.{suffix}"] = value.contiguous()
        dequantized[name] = rounded.dequantized()
    save_file(stored, str(tmp_path / "mtp.safetensors"))
    chunked = {"enable_prefix_caching": False, "max_num_batched_tokens": 16, "max_num_seqs": 4}
    llm = make_llm(tmp_path, speculative_config=_mtp(), **chunked)
    drafter = llm.engine.speculator.draft
    for linear in (drafter.predictor.fc, drafter.predictor.layers[0].self_attn.q_proj):
        assert not isinstance(linear.linear_method, UnquantizedLinearMethod)
    records = record_drafts(drafter)
    _generate(llm, _prompts(2, seed=21), max_tokens=10)
    assert len(records) >= 3
    for tokens, drafts in records:
        assert drafts == reference_drafts(dequantized, checkpoint.reference, tokens, K)[: len(drafts)]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_the_planners_count_is_the_layers(moe):
    from fitserve.models.checkpoint_config import CheckpointConfig
    from fitserve.models.qwen3_5_config import qwen3_5_values
    from fitserve.models.qwen3_5_mtp import Qwen3_5MultiTokenPredictor
    from fitserve.planner.model_shape import ModelShape
    from fitserve.planner.qwen3_5_shape import qwen3_5_mtp_parameter_count

    values = qwen3_5_values(_text_config([LIN, FULL]).to_dict())
    config = CheckpointConfig({**values, **(MOE if moe else {})})
    with torch.device("meta"):
        predictor = Qwen3_5MultiTokenPredictor(config)
    shape = ModelShape.from_hf_config(config)
    counted = qwen3_5_mtp_parameter_count(shape)
    assert counted == sum(p.numel() for p in predictor.parameters())


def test_the_engine_turns_auto_mtp_on_and_says_why(target, caplog):
    """No --speculative-config: the engine built from the checkpoint drafts with its MTP layer, the log
    line says so; '{}' keeps speculation off."""
    import logging

    folder, _ = target
    args = EngineArgs(model=str(folder), device="cpu", dtype="float32", max_model_len=256)
    fit = plan_settings(args)
    (choice,) = [c for c in fit.choices if c.setting == "speculative_config"]
    assert choice.value == "mtp" and not choice.explicit
    assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 3}
    with caplog.at_level(logging.INFO, logger="fitserve"):
        llm = make_llm(folder)
    assert llm.engine.speculator is not None
    assert "speculative_config = mtp (auto-fit: the checkpoint has an MTP layer" in caplog.text
    off = EngineArgs(
        model=str(folder), device="cpu", dtype="float32", max_model_len=256, speculative_config={}
    )
    assert not [c for c in plan_settings(off).choices if c.setting == "speculative_config"]
    assert make_llm(folder, speculative_config={}).engine.speculator is None
