"""FP8 weights on the GPU (layers/quantization/fp8_compute.py, fp8_block.py) against a
dequantize-then-matmul reference in float32, at the Llama-3.1-8B layer shapes, rows 1 to 8192:

- W8A8 row-wise (compute capability >= 8.9): torch._scaled_mm, per-token activation scales (or a static
  per-tensor one) and per-channel weight scales; the reference multiplies the same fp8 activations
  (x_q * x_scale) by the dequantized weight, so only accumulation order and the bfloat16 output differ:
  |y - ref| <= 2**-7 * max|ref|. Up to 16 rows run the W8A16 kernel: the reference is then x @ w.T.
- W8A8 block-scaled (128 x 128 weight blocks, 1 x 128 activation groups): the same bound.
- weight-only (forced, as for a weight-only checkpoint): up to 16 rows through the W8A16 kernel
  (kernels/fp8_w8a16.py, on 8.9 and up), more through chunks dequantized to the activation dtype and
  cuBLAS: against x @ dequantize(w).T, the same bound.
- the Triton activation kernels (kernels/fp8_quant.py) equal the torch reference bit for bit;
- the engine end to end: --quantization fp8 with dummy weights on a Llama-3.1-8B-shaped layer stack
  (2 layers) starts, uses the W8A8 path and generates; a 128 x 128 block fp8 checkpoint (quant_method
  fp8) runs the block-scaled GEMM and its prompt logprobs are within 0.1 of the dequantized HF model.
Skipped without CUDA; the W8A8 cases are skipped below compute capability 8.9.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import fitserve.layers.quantization.fp8_compute as fp8_compute  # noqa: E402
from fitserve.kernels.fp8_w8a16 import MAX_ROWS  # noqa: E402
from fitserve.layers.quantization.fp8_block import quantize_activation_groups_reference  # noqa: E402
from fitserve.layers.quantization.fp8_weight import dequantize, random_fp8_weight  # noqa: E402

pytestmark = pytest.mark.gpu

TOLERANCE = 2**-7
ROWS = (1, 3, 16, 17, 128, 1024, 8192)
# (K, N) of the Llama-3.1-8B linear layers (qkv, o, gate_up, down)
LLAMA_8B = ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096))
W8A8 = torch.cuda.get_device_capability() >= fp8_compute.W8A8_MIN_CAPABILITY
needs_w8a8 = pytest.mark.skipif(not W8A8, reason="fp8 W8A8 needs compute capability 8.9")


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = None


def _weight(k: int, n: int, group: int | None, seed: int):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return random_fp8_weight(n, k, group, 0.02, generator, "cuda")


def _error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected).abs().max() / expected.abs().max())


@needs_w8a8
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("k", "n"), LLAMA_8B)
def test_rowwise_w8a8_matches_reference(k, n, rows) -> None:
    weight = _weight(k, n, None, seed=k + n)
    layer = _Layer()
    method = fp8_compute.make_fp8_runnable(
        layer, weight, None, torch.bfloat16, "dynamic", "test", torch.device("cuda")
    )
    assert method.path == "w8a8"
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    x_q, x_scale = fp8_compute.quantize_activations_reference(x, None)
    expected = (x_q.float() * x_scale) @ dequantize(weight).t()
    if rows <= 16:  # decode rows: the W8A16 kernel, activations not quantized
        expected = x.float() @ dequantize(weight).t()
    got = method.apply(layer, x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert _error(got, expected) <= TOLERANCE


@needs_w8a8
@pytest.mark.parametrize("rows", (1, 17, 1024))
def test_static_input_scale_w8a8_matches_reference(rows) -> None:
    k, n = LLAMA_8B[0]
    weight = _weight(k, n, None, seed=1)
    layer = _Layer()
    input_scale = torch.tensor(4.0 / 448)
    method = fp8_compute.make_fp8_runnable(
        layer, weight, input_scale, torch.bfloat16, "static", "test", torch.device("cuda")
    )
    assert method.path == "w8a8"
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    x_q, x_scale = fp8_compute.quantize_activations_reference(x, input_scale.cuda())
    expected = (x_q.float() * x_scale) @ dequantize(weight).t()
    if rows <= 16:  # decode rows: the W8A16 kernel, activations not quantized
        expected = x.float() @ dequantize(weight).t()
    assert _error(method.apply(layer, x), expected) <= TOLERANCE


@needs_w8a8
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("k", "n"), LLAMA_8B)
def test_block_w8a8_matches_reference(k, n, rows) -> None:
    weight = _weight(k, n, 128, seed=k * 3 + n)
    weight.scale = weight.scale[::128].repeat_interleave(128, 0).contiguous()  # 128 x 128 blocks
    layer = _Layer()
    method = fp8_compute.make_fp8_runnable(
        layer, weight, None, torch.bfloat16, "dynamic", "test", torch.device("cuda")
    )
    assert method.path == "w8a8-block", "torch's block-scaled scaled_mm did not run (see the log)"
    assert method.decode_kernel  # up to 16 rows run kernels/fp8_w8a16.py: the activations stay 16-bit
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    if rows <= MAX_ROWS:
        x_deq = x.float()
    else:
        x_q, x_scale = quantize_activation_groups_reference(x)
        x_deq = (x_q.float().view(rows, -1, 128) * x_scale.unsqueeze(-1)).view(rows, k)
    expected = x_deq @ dequantize(weight).t()
    assert _error(method.apply(layer, x), expected) <= TOLERANCE


@pytest.mark.parametrize("group", (None, 128))
@pytest.mark.parametrize("rows", (1, 3, 16, 17, 1024, 8192))
@pytest.mark.parametrize(("k", "n"), LLAMA_8B)
def test_weight_only_matches_reference(k, n, rows, group, monkeypatch) -> None:
    monkeypatch.setattr(fp8_compute, "w8a8_supported", lambda device: False)  # as below 8.9
    weight = _weight(k, n, group, seed=k + 2 * n)
    layer = _Layer()
    method = fp8_compute.make_fp8_runnable(
        layer, weight, None, torch.bfloat16, "dynamic", "test", torch.device("cuda")
    )
    assert method.path == "weight-only"
    # up to 16 rows run kernels/fp8_w8a16.py from 7.5 (below 8.9 on the weight's bytes)
    assert method.decode_kernel == (torch.cuda.get_device_capability() >= (7, 5))
    assert layer.fp8_weight.dtype == torch.float8_e4m3fn  # kept one byte a weight
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    expected = x.float() @ dequantize(weight).t()
    assert _error(method.apply(layer, x), expected) <= TOLERANCE


@needs_w8a8
def test_quantization_fp8_engine_runs_w8a8_with_dummy_weights(tmp_path) -> None:
    from fitserve import LLM, SamplingParams
    from fitserve.layers.quantization.fp8_method import Fp8LinearMethod
    from tests.model_folders import write_config_with_tokenizer

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 2,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 49152,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
    }
    write_config_with_tokenizer(tmp_path, config, indent=None)
    llm = LLM(
        str(tmp_path),
        load_format="dummy",
        quantization="fp8",
        dtype="bfloat16",
        max_model_len=512,
        gpu_memory_utilization=0.3,
    )
    methods = [
        module.linear_method
        for module in llm.engine.executor.runner.model.modules()
        if isinstance(getattr(module, "linear_method", None), Fp8LinearMethod)
    ]
    assert len(methods) == 2 * 4 and {method.path for method in methods} == {"w8a8"}
    sampling = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], sampling, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


@needs_w8a8
def test_block_fp8_checkpoint_matches_the_dequantized_model(tmp_path) -> None:
    """A quant_method fp8 checkpoint with 128 x 128 blocks (Qwen3 shape, dims multiples of 128) runs the
    block-scaled GEMM; its prompt logprobs are within 0.1 of the HF model holding the dequantized weights
    (W8A8's activation rounding and bfloat16)."""
    from fitserve import LLM, SamplingParams
    from fitserve.layers.quantization.fp8_method import Fp8LinearMethod
    from tests.fp8_checkpoints import Fp8Spec, write_fp8
    from tests.unit.model_helpers import build_hf_model, tiny_hf_config

    dims = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
    dims["head_dim"] = 64
    hf_model = build_hf_model(tiny_hf_config("Qwen3ForCausalLM", **dims), seed=11)
    checkpoint = write_fp8(tmp_path / "block", hf_model, Fp8Spec("hf", "block", "dynamic", block=(128, 128)))
    llm = LLM(str(checkpoint.folder), dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.3)
    methods = [
        module.linear_method
        for module in llm.engine.executor.runner.model.modules()
        if isinstance(getattr(module, "linear_method", None), Fp8LinearMethod)
    ]
    assert methods and {method.path for method in methods} == {"w8a8-block"}
    prompt = [5, 17, 33, 2, 90, 11, 200, 3, 44, 61]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    got = torch.tensor([output.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i > 0])
    with torch.no_grad():
        logits = checkpoint.dequantized_model.float()(torch.tensor([prompt])).logits[0]
    expected = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    assert (got - expected).abs().max().item() < 0.1


@pytest.mark.parametrize("rows", (1, 5, 300))
@pytest.mark.parametrize("k", (4096, 14336, 200))
def test_activation_kernels_equal_the_torch_reference(rows, k) -> None:
    from fitserve.layers.quantization.fp8_block import (
        quantize_activation_groups,
        quantize_activation_groups_reference,
    )

    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) * 3
    x[0, :7] = 0  # a zero-prefixed row and, below, an all-zero row take the 1e-12 floor
    if rows > 1:
        x[1] = 0
    for static in (None, torch.tensor([0.02], device="cuda")):
        got_q, got_s = fp8_compute.quantize_activations(x, static)
        ref_q, ref_s = fp8_compute.quantize_activations_reference(x, static)
        assert torch.equal(got_s, ref_s)
        assert torch.equal(got_q.view(torch.uint8), ref_q.view(torch.uint8))
    if k % 128 == 0:
        got_q, got_s = quantize_activation_groups(x)
        ref_q, ref_s = quantize_activation_groups_reference(x)
        assert got_s.stride() == (1, rows) and torch.equal(got_s, ref_s)
        assert torch.equal(got_q.view(torch.uint8), ref_q.view(torch.uint8))


def _qwen3_run(cpu_offload_gb: float, enforce_eager: bool) -> tuple[list, str, int]:
    """--quantization fp8 with dummy weights on the Qwen3-0.6B shape: greedy tokens, the first layer's
    path and the offloaded bytes."""
    import gc
    import random

    from fitserve import LLM, SamplingParams
    from tests.paths import MODELS_DIR, SMOLLM2_TOKENIZER_DIR

    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(
        str(MODELS_DIR / "qwen3-0.6b"),
        tokenizer=str(SMOLLM2_TOKENIZER_DIR),
        load_format="dummy",
        quantization="fp8",
        seed=0,
        max_model_len=1024,
        max_num_seqs=8,
        gpu_memory_utilization=0.3,
        enforce_eager=enforce_eager,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]},
        cpu_offload_gb=cpu_offload_gb,
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(49152) for _ in range(rng.randint(8, 120))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    model = llm.engine.executor.runner.model
    offload = getattr(model, "cpu_offload", None)
    result = (
        [o.outputs[0].token_ids for o in outputs],
        model.model.layers[0].self_attn.qkv_proj.linear_method.path,
        0 if offload is None else offload.offloaded_bytes,
    )
    del llm, model, offload, outputs
    gc.collect()
    torch.cuda.empty_cache()
    return result


@needs_w8a8
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda_graphs"])
def test_fp8_layers_run_w8a8_with_cuda_graphs_and_cpu_offload(enforce_eager) -> None:
    """CUDA graphs replay the W8A8 path; offloaded fp8 layers (kept fp8 in CPU memory, copied in before
    each forward) run the same path and change no greedy token."""
    resident_tokens, resident_path, _ = _qwen3_run(0.0, enforce_eager)
    offloaded_tokens, offloaded_path, offloaded_bytes = _qwen3_run(0.1, enforce_eager)
    assert resident_path == offloaded_path == "w8a8"
    assert offloaded_bytes >= 0.1 * (1 << 30)
    assert offloaded_tokens == resident_tokens


@needs_w8a8
@pytest.mark.parametrize(("n", "k"), [(4096, 14336), (4096, 4096), (6144, 4096)])
def test_w8a16_split_k_matches_one_split_and_resets_its_counters(n, k) -> None:
    from fitserve.kernels.capability import sm_count
    from fitserve.kernels.fp8_w8a16 import choose_splits, fp8_w8a16_linear, split_counters

    assert choose_splits(n, k, 32, 256, sm_count(torch.device("cuda"))) > 1  # these layers do split
    weight = _weight(k, n, None, 0)  # per-channel scales
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    counters = split_counters(n, "cuda")
    split = fp8_w8a16_linear(x, weight.data, weight.scale, counters=counters)
    whole = fp8_w8a16_linear(x, weight.data, weight.scale)
    reference = x.float() @ dequantize(weight).T
    assert (split.float() - reference).abs().max() <= 2**-7 * reference.abs().max()
    assert (split.float() - whole.float()).abs().max() <= 2**-7 * reference.abs().max()
    assert not counters.any()
    assert torch.equal(split, fp8_w8a16_linear(x, weight.data, weight.scale, counters=counters))


@pytest.mark.skipif(torch.cuda.get_device_capability() < (8, 0), reason="bfloat16 math from 8.0")
@pytest.mark.parametrize(("group", "rows"), [(None, 1), (128, 1), (None, 16), (128, 5)])
def test_w8a16_decoding_bytes_equals_tritons_conversion(group, rows, monkeypatch) -> None:
    import fitserve.kernels.fp8_bits as fp8_bits
    from fitserve.kernels.fp8_w8a16 import fp8_w8a16_linear

    weight = _weight(4096, 6144, group, 3)
    x = torch.randn(rows, 4096, device="cuda").to(torch.bfloat16)
    assert fp8_bits.decodes_bf16_from_bytes(x.device, x.dtype)
    by_bits = fp8_w8a16_linear(x, weight.data, weight.scale)
    if not W8A8:
        pytest.skip("below 8.9 the weight is bytes either way")
    monkeypatch.setattr(fp8_bits, "BF16_FROM_BYTES", False)
    converted = fp8_w8a16_linear(x, weight.data, weight.scale)
    assert torch.equal(by_bits, converted)  # the same bfloat16 weights into the same MMAs
    assert _error(by_bits, x.float() @ dequantize(weight).T) <= TOLERANCE
