"""EAGLE-3 speculation (method eagle3) on tiny random models (CPU): a Llama target and an EAGLE-3 head
written by the test in the released format (safetensors + config.json, d2t/t2d over a reduced draft
vocabulary). Lossless against the same engine without it (greedy token for token; with temperature, in
distribution); the target's streams handed to the head are HF's hidden states at the right positions;
the head's drafts equal a reference computed without any cache; bad heads refused before loading."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch
from safetensors.torch import save_file

from fitserve.args import EngineArgs
from fitserve.planner.resolve import plan_settings
from tests.unit.model_helpers import TINY_DIMS
from tests.unit.test_engine_vs_hf import make_llm, save_tiny_model
from tests.unit.test_spec_decode_engine import (
    _chi_square_p_value,
    _generate,
    _prompts,
    _token_ids,
    each_engine_setting,
    record_drafts,
)

K = 3
HIDDEN = TINY_DIMS["hidden_size"]
VOCAB = TINY_DIMS["vocab_size"]
DRAFT_VOCAB = 48
HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 4, 2, 16, 96
AUX_IDS = (0, 1, 2)  # the embeddings, the first layer's output and the last one's (before the norm)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    model = save_tiny_model(path, "LlamaForCausalLM")
    return path, model


def _head_config(**overrides) -> dict:
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(AUX_IDS)},
    }
    config.update(overrides)
    return config


def _head_tensors(seed: int, target_hidden: int = HIDDEN, draft_ids=None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) / math.sqrt(cols)

    def norm() -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(HIDDEN, generator=g)

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    if draft_ids is None:  # a reduced vocabulary: every fifth target id
        draft_ids = torch.arange(DRAFT_VOCAB) * 5
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[draft_ids[draft_ids < VOCAB]] = True
    return {
        "midlayer.self_attn.q_proj.weight": matrix(q, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": matrix(kv, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": matrix(kv, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": matrix(HIDDEN, q),
        "midlayer.mlp.gate_proj.weight": matrix(INTERMEDIATE, HIDDEN),
        "midlayer.mlp.up_proj.weight": matrix(INTERMEDIATE, HIDDEN),
        "midlayer.mlp.down_proj.weight": matrix(HIDDEN, INTERMEDIATE),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "fc.weight": matrix(HIDDEN, 3 * target_hidden),
        "norm.weight": norm(),
        "lm_head.weight": torch.randn(DRAFT_VOCAB, HIDDEN, generator=g),
        "d2t": (draft_ids - torch.arange(DRAFT_VOCAB)).to(torch.long),
        "t2d": t2d,
    }


def save_head(path, seed: int = 7, config: dict | None = None, tensors: dict | None = None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or _head_config()))
    save_file(tensors if tensors is not None else _head_tensors(seed), str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return save_head(tmp_path_factory.mktemp("head"))


def _eagle(head, k: int = K) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}


@each_engine_setting
def test_greedy_output_equals_no_speculation(target, head, llm_kwargs):
    folder, _ = target
    prompts = _prompts(4, seed=1)
    plain = make_llm(folder, **llm_kwargs)
    spec = make_llm(folder, speculative_config=_eagle(head), **llm_kwargs)
    expected = _token_ids(_generate(plain, prompts, max_tokens=30))
    assert _token_ids(_generate(spec, prompts, max_tokens=30)) == expected
    stats = spec.engine.speculator.stats
    assert stats.num_draft_tokens > 0
    # again: prompts found in the target's prefix cache (the head reads zeros there): still exact
    assert _token_ids(_generate(spec, prompts, max_tokens=30)) == expected


def test_back_off_preemption_and_n(target, head):
    folder, _ = target
    prompts = _prompts(6, seed=5)
    kwargs = {"num_gpu_blocks_override": 14, "max_num_seqs": 6}
    params = {"max_tokens": 30, "n": 2}
    expected = _token_ids(_generate(make_llm(folder, **kwargs), prompts, **params))
    spec = make_llm(folder, speculative_config=_eagle(head), **kwargs)
    speculator = spec.engine.speculator
    wants, calls = speculator.wants_drafts, []

    def every_other(running):
        calls.append(1)
        return len(calls) % 2 == 0 and wants(running)

    speculator.wants_drafts = every_other
    assert _token_ids(_generate(spec, prompts, **params)) == expected
    assert spec.engine.scheduler.num_preemptions_total > 0
    drafter = speculator.draft
    drafter.propose([], set())
    assert not drafter.sequences
    assert drafter.kv_manager.num_free_blocks == drafter.kv_manager.pool.num_usable_blocks


def test_long_pause_computes_streams_eagerly(target, head, monkeypatch):
    """With speculation off for many steps, no request holds more than EAGER_ROWS (+ one step's) rows of
    the target's streams, and the drafts that follow are still exact."""
    import fitserve.spec_decode.eagle3.drafter as eagle3

    monkeypatch.setattr(eagle3, "EAGER_ROWS", 4)
    folder, _ = target
    prompts = _prompts(3, seed=4)
    expected = _token_ids(_generate(make_llm(folder), prompts, max_tokens=30))
    spec = make_llm(folder, speculative_config=_eagle(head))
    speculator = spec.engine.speculator
    wants, calls, most = speculator.wants_drafts, [], []

    def late(running):
        calls.append(1)
        for seq in speculator.draft.sequences.values():
            most.append(sum(t.shape[0] for _, t in seq.pending))
        return len(calls) > 15 and wants(running)

    speculator.wants_drafts = late
    assert _token_ids(_generate(spec, prompts, max_tokens=30)) == expected
    assert speculator.stats.num_draft_tokens > 0
    assert most and max(most) <= 4 + 1


def _hf_streams(hf_model, tokens: list[int]) -> torch.Tensor:
    """HF's streams at AUX_IDS for every position: hidden_states[0] and [1], and the last layer's output
    before the final norm (HF's last entry is after it), caught by a hook. [N, 3 x hidden]."""
    caught = []
    hook = hf_model.model.layers[-1].register_forward_hook(
        lambda module, args, output: caught.append(output[0] if isinstance(output, tuple) else output)
    )
    try:
        with torch.no_grad():
            hidden = hf_model.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    return torch.cat([hidden[0][0], hidden[1][0], caught[0].reshape(len(tokens), -1)], dim=-1)


def test_streams_are_the_targets_hidden_states(target, head):
    """The rows the head receives are HF's hidden states at its layers, at the step's positions."""
    folder, hf_model = target
    llm = make_llm(folder, speculative_config=_eagle(head), enable_prefix_caching=False)
    drafter = llm.engine.speculator.draft
    prompt = _prompts(1, seed=3)[0]
    seen: dict[int, torch.Tensor] = {}
    original = drafter.after_launch

    def spy(scheduler_output):
        rows = drafter.aux[: scheduler_output.num_batched_tokens].clone()
        offset = 0
        for item in scheduler_output.scheduled:
            for j in range(item.num_new_tokens):  # a later step's row supersedes (a refused draft's)
                seen[item.start + j] = rows[offset + j]
            offset += item.num_new_tokens
        original(scheduler_output)

    drafter.after_launch = spy
    tokens = _token_ids(_generate(llm, [prompt], max_tokens=8))[0][0]
    sequence = prompt + tokens
    expected = _hf_streams(hf_model, sequence)
    # the last layer's output is checked through HF's final norm as well: it is hidden_states[-1]
    assert len(seen) >= len(sequence) - 1
    for position in range(len(sequence) - 1):
        torch.testing.assert_close(
            seen[position], expected[position], atol=1e-4, rtol=1e-4, msg=lambda m, p=position: f"{p}: {m}"
        )


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    half = x.shape[-1] // 2
    inv = 1.0 / theta ** (torch.arange(half, dtype=torch.float32) * 2 / x.shape[-1])
    angles = positions[:, None].float() * inv[None]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def _reference_drafts(tensors, embed: torch.Tensor, streams: torch.Tensor, tokens: list[int], k: int):
    """EAGLE-3's drafts computed with no cache: the whole row sequence through the layer each step."""

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)

    t = tensors
    fc = streams @ t["fc.weight"].T  # [N - 1, H]: rows 0..N-2
    row_tokens = list(tokens[1:])
    row_hidden = [fc[p] for p in range(len(tokens) - 1)]
    drafts = []
    for _ in range(k):
        n = len(row_tokens)
        e = rms(embed[torch.tensor(row_tokens)], t["midlayer.input_layernorm.weight"])
        h = torch.stack(row_hidden)
        x = torch.cat([e, rms(h, t["midlayer.hidden_norm.weight"])], dim=-1)
        q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM)
        kk = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
        v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
        pos = torch.arange(n)
        q, kk = _rope(q, pos), _rope(kk, pos)
        kk = kk.repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
        residual = h + attn @ t["midlayer.self_attn.o_proj.weight"].T
        m = rms(residual, t["midlayer.post_attention_layernorm.weight"])
        mlp = (
            torch.nn.functional.silu(m @ t["midlayer.mlp.gate_proj.weight"].T)
            * (m @ t["midlayer.mlp.up_proj.weight"].T)
        ) @ t["midlayer.mlp.down_proj.weight"].T
        prenorm = residual + mlp
        logits = rms(prenorm[-1], t["norm.weight"]) @ t["lm_head.weight"].T
        draft_id = int(logits.argmax())
        token = draft_id + int(t["d2t"][draft_id])
        drafts.append(token)
        row_tokens.append(token)
        row_hidden.append(prenorm[-1])
    return drafts


def test_drafts_equal_a_reference_without_cache(target, head):
    """The head's drafts (catch-up from the target's streams, then its own recurrence, through its paged
    cache) equal EAGLE-3 computed from scratch; again after the request gained tokens."""
    from fitserve import SamplingParams
    from fitserve.core.request import Request

    folder, hf_model = target
    llm = make_llm(folder, speculative_config=_eagle(head, k=4), enable_prefix_caching=False)
    drafter = llm.engine.speculator.draft
    tensors = _head_tensors(7)
    embed = hf_model.model.embed_tokens.weight.detach()
    prompt = _prompts(1, seed=8)[0]
    request = Request("r", "r", 0, list(prompt), SamplingParams(max_tokens=64), frozenset())

    def streams_of(tokens):
        return _hf_streams(hf_model, tokens)

    from fitserve.core.scheduler import ScheduledRequest, SchedulerOutput

    def feed(tokens, start):
        """What the engine's steps would hand the head: the target's streams of positions start.."""
        streams = streams_of(tokens)
        rows = streams[start : len(tokens) - 1]
        drafter.aux[: rows.shape[0]] = rows
        item = ScheduledRequest(request, start, rows.shape[0], [], True)
        drafter.after_launch(SchedulerOutput([item], rows.shape[0]))

    feed(request.all_token_ids, 0)
    (got,) = drafter.propose([request], {"r"})
    assert got == _reference_drafts(
        tensors, embed, streams_of(request.all_token_ids)[:-1], request.all_token_ids, 4
    )
    before = len(request.all_token_ids) - 1
    for token in (got[0], 17, 33):
        request.append_output_token(token)
    feed(request.all_token_ids, before)
    (again,) = drafter.propose([request], {"r"})
    tokens = request.all_token_ids
    assert again == _reference_drafts(tensors, embed, streams_of(tokens)[:-1], tokens, 4)


def test_sampling_keeps_the_target_distribution(target, head):
    folder, _ = target
    prompt = _prompts(1, seed=6)[0]
    plain = make_llm(folder, max_num_seqs=64)
    spec = make_llm(folder, speculative_config=_eagle(head), max_num_seqs=64)
    params = {"temperature": 1.0, "top_k": 3, "max_tokens": 4, "n": 400}
    plain_paths = Counter(tuple(c[1:3]) for c in _token_ids(_generate(plain, [prompt], seed=11, **params))[0])
    spec_paths = Counter(tuple(c[1:3]) for c in _token_ids(_generate(spec, [prompt], seed=12, **params))[0])
    assert spec.engine.speculator.stats.num_draft_tokens > 0
    assert _chi_square_p_value(plain_paths, spec_paths) > 1e-3


@pytest.fixture(scope="module")
def bad_heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    plain = _head_tensors(1)
    no_fc = {k: v for k, v in plain.items() if k != "fc.weight"}
    outside = _head_tensors(1, draft_ids=torch.arange(DRAFT_VOCAB) * 6)  # up to 282 > 255
    return {
        "keys": save_head(root / "keys", tensors=no_fc),
        "hidden": save_head(
            root / "hidden", config=_head_config(target_hidden_size=32), tensors=_head_tensors(1, 32)
        ),
        "vocab": save_head(root / "vocab", config=_head_config(vocab_size=300), tensors=plain),
        "d2t": save_head(root / "d2t", tensors=outside),
        "arch": save_head(root / "arch", config=_head_config(architectures=["LlamaForCausalLM"])),
        "layers": save_head(root / "layers", config=_head_config(eagle_config={})),
        "no-embedding": save_head(root / "no-embedding", tensors=plain),  # reads the target's embedding
    }


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [
        ("keys", {}, "no EAGLE-3 tensors fc.weight"),
        ("hidden", {}, "target of hidden size 32, the target .* has 64"),
        ("vocab", {}, "vocabulary of 300 tokens"),
        ("d2t", {}, "target ids 0..282, outside the target's vocabulary of 256"),
        ("arch", {}, "not an EAGLE-3 head"),
        ("layers", {}, "reads the target's layers \\[2, 1, -1\\]"),
        (
            "no-embedding",
            {"tensor_parallel_size": 2, "load_format": "dummy"},
            "has no embed_tokens of its own .* --tensor-parallel-size 2 splits over the ranks; rank 0 reads",
        ),
    ],
)
def test_bad_heads_are_refused_before_loading(target, bad_heads, name, kwargs, match, monkeypatch):
    import fitserve.spec_decode.eagle3.head as eagle3

    folder, _ = target
    built = []
    monkeypatch.setattr(eagle3.Eagle3Head, "__init__", lambda *a, **k: built.append(1))
    with pytest.raises(ValueError, match=match):
        make_llm(folder, speculative_config=_eagle(bad_heads[name]), **kwargs)
    assert not built


def test_a_target_other_than_the_llama_family_is_refused():
    from types import SimpleNamespace

    from fitserve.spec_decode.eagle3 import check_eagle3_target

    config = SimpleNamespace(
        speculative=SimpleNamespace(draft_tensor_parallel_size=None),
        parallel=SimpleNamespace(tensor_parallel_size=1),
        model=SimpleNamespace(hf_config=SimpleNamespace(architectures=["Gemma4ForCausalLM"])),
    )
    with pytest.raises(ValueError, match="eagle3 on Gemma4ForCausalLM is not built yet.*Llama, Mistral"):
        check_eagle3_target(config)


def test_eagle_1_is_refused_with_what_runs():
    from fitserve.spec_decode.config import parse_speculative_config

    with pytest.raises(ValueError, match="EAGLE-1 draft heads.*method eagle3"):
        parse_speculative_config({"method": "eagle", "model": "x", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match='eagle3 needs "model"'):
        parse_speculative_config({"method": "eagle3", "num_speculative_tokens": 3})


def test_the_plan_counts_the_head(target, head):
    folder, _ = target
    base = {"model": str(folder), "device": "cpu", "dtype": "float32", "cpu_kv_cache_space": 0.01}
    plain = plan_settings(EngineArgs(**base)).plan
    plan = plan_settings(EngineArgs(**base, speculative_config=_eagle(head))).plan
    assert plan.kv_bytes_per_token == plain.kv_bytes_per_token + 2 * KV_HEADS * HEAD_DIM * 4
    assert plan.estimated.weights > plain.estimated.weights


@pytest.mark.parametrize("pause", [False, True], ids=["every-step", "paused-then-eager"])
def test_engine_drafts_equal_the_reference(target, head, pause, monkeypatch):
    """Through the engine (chunked prefill, verify steps, refused drafts, steps without drafts and the
    eager catch-up), each draft equals EAGLE-3 computed from scratch on the request's tokens then."""
    import fitserve.spec_decode.eagle3.drafter as eagle3

    monkeypatch.setattr(eagle3, "EAGER_ROWS", 4)
    folder, hf_model = target
    llm = make_llm(
        folder,
        speculative_config=_eagle(head),
        enable_prefix_caching=False,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    speculator = llm.engine.speculator
    drafter = speculator.draft
    if pause:
        wants, calls = speculator.wants_drafts, []

        def some(running):
            calls.append(1)
            return len(calls) % 5 == 0 and wants(running)

        speculator.wants_drafts = some
    records = record_drafts(drafter)
    _generate(llm, _prompts(3, seed=13), max_tokens=20)
    assert len(records) >= 5
    tensors = _head_tensors(7)
    embed = hf_model.model.embed_tokens.weight.detach()
    for tokens, drafts in records:
        streams = _hf_streams(hf_model, tokens)[:-1]
        assert drafts == _reference_drafts(tensors, embed, streams, tokens, K)[: len(drafts)]


def test_a_long_prompt_step_is_not_kept_alive_by_its_last_row(target, head):
    """After a prefill step of more than COMPACT_ROWS rows, the rows still waiting are copies, not views
    of the whole step; the output stays exact."""
    folder, _ = target
    prompt = [(7 * j) % 250 + 3 for j in range(300)]
    expected = _token_ids(_generate(make_llm(folder), [prompt], max_tokens=6))
    spec = make_llm(folder, speculative_config=_eagle(head))
    drafter = spec.engine.speculator.draft
    original, bases = drafter.after_launch, []

    def spy(scheduler_output):
        original(scheduler_output)
        for seq in drafter.sequences.values():
            # rows of the tensor each waiting row keeps alive
            for _, t in seq.pending:
                bases.append(t.untyped_storage().nbytes() // (t.shape[1] * t.element_size()))

    drafter.after_launch = spy
    assert _token_ids(_generate(spec, [prompt], max_tokens=6)) == expected
    assert bases and max(bases) <= 256
