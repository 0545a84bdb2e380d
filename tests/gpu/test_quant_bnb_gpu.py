"""bitsandbytes 4-bit (nf4 / fp4) on the GPU: the fused nf4 GEMM (kernels/nf4_gemm.py) and the chunked
dequantize + cuBLAS path (kernels/nf4_dequant.py) against x.float() @ dequantize(W).T at the Llama-3.1-8B
shapes, rows 1 to 8192, block sizes 64 / 128 / 256; CUDA-graph capture; a model loaded with
--quantization bitsandbytes and with dummy nf4 weights through the engine's layer path.

Tolerance: |y - ref| <= tol * max|ref|, tol 2**-6 for bfloat16, 2**-8 for float16: the absmax is kept in
float16, the tensor-core kernels round each weight to x's dtype, y is rounded to it (a wrong code, nibble
order or block gives errors of order max|ref|).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from fitserve.kernels.nf4_dequant import chunked_nf4_linear  # noqa: E402
from fitserve.kernels.nf4_gemm import nf4_linear  # noqa: E402
from fitserve.kernels.nf4_pack import pack_nf4  # noqa: E402
from fitserve.layers.quantization.bnb_runtime import make_bnb_runnable  # noqa: E402
from fitserve.layers.quantization.bnb_weight import dequantize, quantize_4bit, random_nf4_weight  # noqa: E402
from tests.model_folders import save_with_tokenizer  # noqa: E402

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.bfloat16: 2**-6, torch.float16: 2**-8}
# (K, N) of Llama-3.1-8B's linear layers: qkv, o, gate_up, down
LLAMA_8B = ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096))
FUSED_ROWS = (1, 2, 7, 16, 33, 64, 128)
CHUNKED_ROWS = (129, 512, 2048, 8192)


def weight_of(out_features: int, in_features: int, blocksize: int, quant_type: str = "nf4", seed: int = 0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return random_nf4_weight(out_features, in_features, blocksize, 0.02, generator, "cuda", quant_type)


def relative_error(y: torch.Tensor, x: torch.Tensor, reference_weight: torch.Tensor, bias=None) -> float:
    reference = x.float() @ reference_weight.T
    if bias is not None:
        reference += bias.float()
    return ((y.float() - reference).abs().max() / reference.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("in_features", "out_features"), LLAMA_8B)
def test_fused_kernels_at_llama_8b_shapes(in_features: int, out_features: int, dtype) -> None:
    weight = weight_of(out_features, in_features, 64)
    packed = pack_nf4(weight.packed, weight.absmax, weight.code, 64, dtype)
    reference = dequantize(weight)
    for rows in FUSED_ROWS:
        x = torch.randn(rows, in_features, device="cuda").to(dtype)
        y = nf4_linear(x, packed)
        assert relative_error(y, x, reference) <= TOLERANCE[dtype], (rows, in_features, out_features)
        assert not packed.counters.any()
        assert torch.equal(y, nf4_linear(x, packed)), "split-K must be deterministic"


@pytest.mark.parametrize(("in_features", "out_features"), LLAMA_8B)
def test_chunked_path_at_llama_8b_shapes(in_features: int, out_features: int) -> None:
    weight = weight_of(out_features, in_features, 64, seed=1)
    packed = pack_nf4(weight.packed, weight.absmax, weight.code, 64, torch.bfloat16)
    reference = dequantize(weight)
    for rows in CHUNKED_ROWS:
        x = torch.randn(rows, in_features, device="cuda").to(torch.bfloat16)
        y = chunked_nf4_linear(x, packed)
        assert relative_error(y, x, reference) <= TOLERANCE[torch.bfloat16], rows


@pytest.mark.parametrize(
    ("blocksize", "quant_type"), [(128, "nf4"), (256, "fp4"), (64, "fp4"), (4096, "nf4")]
)
def test_block_sizes_and_fp4_with_bias(blocksize: int, quant_type: str) -> None:
    weight = weight_of(4096, 4096, blocksize, quant_type, seed=2)
    packed = pack_nf4(weight.packed, weight.absmax, weight.code, blocksize, torch.bfloat16)
    bias = torch.randn(4096, device="cuda").to(torch.bfloat16)
    for rows in (1, 5, 100, 300):
        x = torch.randn(rows, 4096, device="cuda").to(torch.bfloat16)
        y = nf4_linear(x, packed, bias) if rows <= 128 else chunked_nf4_linear(x, packed, bias)
        assert relative_error(y, x, dequantize(weight), bias) <= 2**-6, (rows, blocksize)


def test_quantize_while_loading_on_the_gpu_matches_the_cpu() -> None:
    weight = torch.randn(512, 1024, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    on_cpu = quantize_4bit(weight, 64)
    on_gpu = quantize_4bit(weight.cuda(), 64)
    assert torch.equal(on_cpu.packed, on_gpu.packed.cpu())
    torch.testing.assert_close(on_cpu.absmax, on_gpu.absmax.cpu(), rtol=0, atol=0)


def test_layer_path_is_fused_and_graph_capturable() -> None:
    layer = torch.nn.Module()
    layer.register_parameter("bias", None)
    weight = weight_of(6144, 4096, 64, seed=4)
    method = make_bnb_runnable(layer, weight, torch.bfloat16, torch.device("cuda"), "test")
    assert method.path == "triton-nf4"
    assert layer.nf4_packed.dtype == torch.uint8 and layer.nf4_scales.dtype == torch.float16
    x = torch.randn(1, 4096, device="cuda").to(torch.bfloat16)
    eager = method.apply(layer, x)
    graph = torch.cuda.CUDAGraph()
    static_x = x.clone()
    method.apply(layer, static_x)  # warm up (compiles) outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static_y = method.apply(layer, static_x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y, eager)
    big = torch.randn(600, 4096, device="cuda").to(torch.bfloat16)  # prefill rows: the chunked path
    assert relative_error(method.apply(layer, big), big, dequantize(weight)) <= 2**-6


ENGINE_DIMS = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
PROMPT = list(range(40, 90))


def hf_prompt_logprobs(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[:-1].gather(1, torch.tensor(PROMPT[1:]).unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize("how", ["nf4 double quant checkpoint", "fp4 checkpoint", "--quantization"])
def test_engine_runs_the_triton_nf4_path_and_matches_the_dequantized_model(how, tmp_path) -> None:
    """Prompt logprobs (50 prompt tokens: the chunked path; then 1-row decode: the fused kernel) within
    0.1 nats of the HF model holding the dequantized weights (float32, CPU); a wrong code, nibble or block
    moves them by whole nats."""
    from fitserve import LLM, SamplingParams
    from fitserve.layers.quantization.bnb_method import BnbLinearMethod
    from tests.bnb_checkpoints import BnbSpec, write_bnb
    from tests.unit.model_helpers import build_hf_model, tiny_hf_config

    hf_model = build_hf_model(tiny_hf_config("Qwen3ForCausalLM", **ENGINE_DIMS), seed=11)
    if how == "--quantization":
        spec = BnbSpec("nf4", reference_fp16_absmax=True)
        folder = save_with_tokenizer(hf_model, tmp_path / "bf16")
        reference = write_bnb(tmp_path / "reference", hf_model, spec).dequantized_model
        kwargs = {"quantization": "bitsandbytes"}
    else:
        quant_type = how.split()[0]
        spec = BnbSpec(quant_type, double_quant="double" in how, reference_fp16_absmax=True)
        checkpoint = write_bnb(tmp_path / spec.name, hf_model, spec)
        folder, reference, kwargs = checkpoint.folder, checkpoint.dequantized_model, {}
    llm = LLM(str(folder), dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.3, **kwargs)
    methods = [
        module.linear_method
        for module in llm.engine.executor.runner.model.modules()
        if isinstance(getattr(module, "linear_method", None), BnbLinearMethod)
    ]
    assert methods and {method.path for method in methods} == {"triton-nf4"}
    params = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0)
    output = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 8
    got = torch.tensor([output.prompt_logprobs[i][token].logprob for i, token in enumerate(PROMPT) if i > 0])
    expected = hf_prompt_logprobs(reference.float().eval())
    assert (got - expected).abs().max().item() < 0.1


def test_dummy_nf4_weights_through_the_engine(tmp_path) -> None:
    from fitserve import LLM, SamplingParams
    from tests.unit.model_helpers import build_hf_model, tiny_hf_config

    model = build_hf_model(tiny_hf_config("LlamaForCausalLM", **ENGINE_DIMS), seed=12)
    folder = save_with_tokenizer(model, tmp_path / "bf16")
    llm = LLM(
        str(folder), dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.3, load_format="dummy",
        quantization="bitsandbytes",
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 16


def test_cpu_offload_keeps_bnb_layers_4bit_on_the_host_and_changes_no_token(tmp_path) -> None:
    """--cpu-offload-gb with --quantization bitsandbytes: the offloaded layers' nf4 tensors (packed codes,
    float16 absmax) stay in host memory and are copied in before each forward; the greedy tokens equal
    those of the same model without offload."""
    from fitserve import LLM, SamplingParams
    from tests.unit.model_helpers import build_hf_model, tiny_hf_config

    model = build_hf_model(tiny_hf_config("LlamaForCausalLM", **ENGINE_DIMS), seed=13)
    folder = save_with_tokenizer(model, tmp_path / "bf16")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = []
    for offload_gb in (0.0, 0.0001):
        llm = LLM(
            str(folder), dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.3,
            quantization="bitsandbytes", cpu_offload_gb=offload_gb,
        )  # fmt: skip
        output = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
        tokens.append(list(output.outputs[0].token_ids))
        offload = getattr(llm.engine.executor.runner.model, "cpu_offload", None)
        if offload_gb:
            assert offload is not None and len(offload.layers) >= 1 and offload.offloaded_bytes > 0
        del llm
        torch.cuda.empty_cache()
    assert tokens[0] == tokens[1]
