"""Qwen3-MoE int4 checkpoints (layers/moe_int4.py) on the CPU, against transformers running the dequantized
weights: tiny random Qwen3-MoE models written as AWQ, GPTQ and compressed-tensors checkpoints whose experts
(one tensor set per expert and projection, as the hub's releases store them) and attention projections are
int4. Greedy tokens equal HF's, logprobs within 2e-3 (float32; the attention's CPU int4 kernel rounds its
steps to float16), the experts' output within 1e-5 of the dequantized experts', with prefix caching and
chunked prefill; TP 2 (intermediate split and expert parallel) equals TP 1; --load-format dummy runs the
same model at TP 1 and TP 2. Refused before loading, naming the fix: act order in the experts, a TP split
of a quantization group, --quantization bitsandbytes on the MoE (fp8 runs: test_qwen3_moe_fp8.py); a
checkpoint missing an expert's tensors is refused naming it. The kernels:
tests/unit/test_fused_moe_int4_interpret.py."""

from __future__ import annotations

import copy
import functools
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model_folders import write_config_with_tokenizer
from tests.quant_checkpoints import QuantSpec, quantization_config
from tests.unit.model_helpers import build_hf_model, tiny_hf_config
from tests.unit.quant_helpers import Quantizer, int4_quantizer, quantized_expert_tensors
from tests.unit.test_engine_vs_hf import PROMPTS, greedy_outputs, hf_greedy, make_llm
from tests.unit.test_qwen3_moe import assert_layout_equals_one_rank

TOLERANCE = 1e-4
# the attention projections run the CPU's C int4 kernel, which keeps a float16 step and minimum per 32
# columns (layers/quantization/int4_cpu.py): logprobs then move by up to ~1e-3 from the dequantized model's
LOGPROB_TOLERANCE = 2e-3
MOE = {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def write_quantized_moe(
    folder: Path, hf_model: torch.nn.Module, quantize: Quantizer, quantization: dict[str, Any] | None
) -> torch.nn.Module:
    """The checkpoint (attention and every expert's projections quantized by `quantize`, one tensor set per
    expert, config.json's quantization_config `quantization`), and the HF model with the dequantized
    weights (the reference)."""
    folder.mkdir(parents=True, exist_ok=True)
    reference = copy.deepcopy(hf_model).eval()
    reference_state = reference.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in sorted(hf_model.state_dict().items()):
        tensor = tensor.detach()
        if name.endswith(tuple(f".{p}.weight" for p in ATTENTION)):
            module = name.removesuffix(".weight")
            stored, dequantized = quantize(module, tensor)
            tensors.update({module + suffix: value.contiguous() for suffix, value in stored.items()})
            reference_state[name].copy_(dequantized)
        elif name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            per_expert, dequantized = quantized_expert_tensors(name, tensor, quantize)
            tensors.update(per_expert)
            reference_state[name].copy_(dequantized)
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    config = hf_model.config.to_dict()
    if quantization is not None:  # None: a 16-bit checkpoint
        config["quantization_config"] = quantization
    write_config_with_tokenizer(folder, config)
    return reference


def write_int4_moe(folder: Path, hf_model: torch.nn.Module, spec: QuantSpec) -> torch.nn.Module:
    """write_quantized_moe in int4 of `spec`, each projection rounded with its own seed."""
    seeds = itertools.count(1)
    quantize = int4_quantizer(spec, lambda module: next(seeds))
    return write_quantized_moe(folder, hf_model, quantize, quantization_config(spec))


SPECS = {
    "awq": QuantSpec("awq", 32, sym=False),
    "gptq": QuantSpec("gptq", 32, sym=True),
    "ct": QuantSpec("ct", 32, sym=False),
}


@functools.cache
def checkpoint(fmt: str, root: str) -> tuple[Path, torch.nn.Module]:
    config = tiny_hf_config("Qwen3MoeForCausalLM", **MOE, norm_topk_prob=True)
    folder = Path(root) / fmt
    return folder, write_int4_moe(folder, build_hf_model(config, seed=3), SPECS[fmt])


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("qwen3_moe_int4"))


@pytest.mark.parametrize("fmt", list(SPECS))
def test_greedy_and_logprobs_follow_the_dequantized_model(root, fmt):
    folder, reference = checkpoint(fmt, root)
    llm = make_llm(folder)
    experts = llm.engine.executor.runner.model.model.layers[0].mlp.experts
    assert type(experts).__name__ == "Int4FusedExperts"
    assert_follows_the_reference(llm, reference)


def assert_follows_the_reference(llm: Any, reference: torch.nn.Module) -> None:
    """The engine's greedy tokens on PROMPTS equal HF's on the dequantized model, and its top-5 logprobs
    along one of them are within LOGPROB_TOLERANCE."""
    assert [o.outputs[0].token_ids for o in greedy_outputs(llm, PROMPTS)] == [
        hf_greedy(reference, p) for p in PROMPTS
    ]
    prompt = PROMPTS[1]
    out = greedy_outputs(llm, [prompt], logprobs=5)[0]
    with torch.no_grad():
        full = torch.tensor([prompt + out.outputs[0].token_ids])
        want = torch.log_softmax(reference(full).logits[0].float(), dim=-1)
    for step, position in enumerate(out.outputs[0].logprobs):
        for token_id, entry in position.items():
            assert abs(entry.logprob - want[len(prompt) - 1 + step][token_id].item()) < LOGPROB_TOLERANCE


def test_the_int4_experts_compute_what_their_dequantized_weights_do(root):
    folder, _ = checkpoint("ct", root)
    assert_experts_compute_their_dequantized_weights(make_llm(folder).engine.executor.runner.model)


def assert_experts_compute_their_dequantized_weights(model: torch.nn.Module) -> None:
    """Layer 1's quantized experts (8 of 64 x 64) give what 16-bit experts holding their dequantized
    weights give, within 1e-5."""
    from fitserve.layers.moe import FusedExperts

    experts = model.model.layers[1].mlp.experts
    dense = FusedExperts(8, 64, 64, torch.nn.functional.silu)
    with torch.no_grad():
        for e in range(8):
            dense.gate_up_proj[e], dense.down_proj[e] = experts.dequantized(e)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=generator)
    ids = torch.randint(0, 8, (5, 2), generator=generator)
    weights = torch.rand(5, 2, generator=generator)
    torch.testing.assert_close(experts(x, ids, weights), dense(x, ids, weights), rtol=1e-5, atol=1e-5)


def test_chunked_prefill_and_prefix_caching_keep_the_tokens(root):
    folder, reference = checkpoint("awq", root)
    assert_chunks_and_cached_prefixes_keep_the_tokens(folder, reference)


def assert_chunks_and_cached_prefixes_keep_the_tokens(folder: Path, reference: torch.nn.Module) -> None:
    """Prompts cut into 6-token chunks, run twice (the second time from the prefix cache): HF's tokens."""
    expected = [hf_greedy(reference, p) for p in PROMPTS]
    llm = make_llm(folder, max_num_batched_tokens=6, max_num_seqs=4)
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in greedy_outputs(llm, PROMPTS)] == expected
    assert llm.engine.kv_manager.prefix_cache_hits > 0


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["intermediate_split", "expert_parallel"])
def test_tp2_equals_tp1(root, expert_parallel):
    folder, _ = checkpoint("gptq", root)
    assert_layout_equals_one_rank(
        folder, {"tensor_parallel_size": 2, "enable_expert_parallel": expert_parallel}
    )


def _config_only(
    root: str, fmt: str, name: str, quant: dict[str, Any] | None = None, quantized: bool = True
) -> Path:
    """A copy of the checkpoint's folder without its weights, its quantization_config updated by `quant`
    (quantized=False: dropped, the config of a 16-bit checkpoint)."""
    source, _ = checkpoint(fmt, root)
    folder = Path(root) / name
    folder.mkdir(exist_ok=True)
    for path in source.iterdir():
        if path.suffix != ".safetensors":
            (folder / path.name).write_bytes(path.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    if not quantized:
        del config["quantization_config"]
    else:
        config["quantization_config"].update(quant or {})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_dummy_weights_are_the_same_model_at_tp1_and_tp2(root):
    assert_dummy_weights_are_one_model_at_tp1_and_tp2(_config_only(root, "awq", "awq-dummy"))


def assert_dummy_weights_are_one_model_at_tp1_and_tp2(folder: Path) -> None:
    """--load-format dummy on the folder's config: the same greedy tokens at TP 1 and TP 2."""
    want = greedy_outputs(make_llm(folder, load_format="dummy"), PROMPTS)
    two = make_llm(folder, load_format="dummy", tensor_parallel_size=2)
    try:
        got = greedy_outputs(two, PROMPTS)
    finally:
        two.engine.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_act_order_experts_are_refused_before_loading(root):
    folder = _config_only(root, "gptq", "gptq-actorder", quant={"desc_act": True})
    with pytest.raises(ValueError, match=r"not int4 with act order \(g_idx\).*desc_act false"):
        make_llm(folder, load_format="dummy")


def test_a_tp_split_of_a_group_is_refused_naming_expert_parallel(root):
    """Groups of 32 of the experts' 64 intermediate columns: 4 ranks would hold 16 each."""
    folder = _config_only(root, "awq", "awq-tp4")
    message = r"each tensor-parallel rank's 16 of them would split a group: run with --enable-expert-parallel"
    with pytest.raises(ValueError, match=message):
        make_llm(folder, load_format="dummy", tensor_parallel_size=4)


def test_bitsandbytes_on_the_moe_is_refused_before_loading(root):
    base = _config_only(root, "awq", "bf16", quantized=False)
    with pytest.raises(ValueError, match=r"Qwen3-MoE model \(8 experts\).*not this format"):
        make_llm(base, load_format="dummy", quantization="bitsandbytes")


def test_a_missing_expert_is_named(root):
    source, _ = checkpoint("awq", root)
    folder = _config_only(root, "awq", "awq-missing")
    tensors = load_file(str(source / "model.safetensors"))
    dropped = {k: v for k, v in tensors.items() if ".experts.5.down_proj." not in k or ".layers.1." not in k}
    save_file(dropped, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.5\.down_proj"):
        make_llm(folder)


def test_a_truncated_expert_tensor_is_refused_naming_it_and_its_shape(root):
    source, _ = checkpoint("awq", root)
    folder = _config_only(root, "awq", "awq-truncated")
    tensors = load_file(str(source / "model.safetensors"))
    name = "model.layers.0.mlp.experts.3.up_proj.qweight"
    tensors[name] = tensors[name][:-1].contiguous()  # [64, 8] -> [63, 8]
    save_file(tensors, str(folder / "model.safetensors"))
    message = (
        r"quantized tensor model\.layers\.0\.mlp\.experts\.3\.up_proj\.qweight has shape \(63, 8\), "
        r"expected \(64, 8\)"
    )
    with pytest.raises(ValueError, match=message):
        make_llm(folder)


@pytest.mark.parametrize("fmt", ["awq", "ct"])
def test_the_planner_counts_the_checkpoints_int4_bytes_from_its_config(root, fmt):
    """stored_int4_from_config on config.json alone equals the bytes of the int4 tensors the checkpoint
    holds (attention and every expert): what `fitserve plan` counts for a folder without weights."""
    from transformers import AutoConfig

    from fitserve.layers.quantization.int4_formats import param_specs, stored_int4_from_config
    from fitserve.layers.quantization.quant_config import quant_format

    folder, _ = checkpoint(fmt, root)
    config = AutoConfig.from_pretrained(str(folder))
    quant = quant_format(config)
    _, stored = stored_int4_from_config(quant, config)
    names = set(param_specs(quant, 64, 64))
    tensors = load_file(str(folder / "model.safetensors"))
    held = sum(t.numel() * t.element_size() for name, t in tensors.items() if name.rsplit(".", 1)[1] in names)
    assert stored == held
