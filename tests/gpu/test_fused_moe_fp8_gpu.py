"""The fp8 fused MoE (fitserve/kernels/fused_moe_fp8.py) on a GPU of compute capability 7.5+ at
Qwen3-30B-A3B-FP8's expert shape (128 experts, top 8, hidden 2048, intermediate 768), with Qwen's
[128, 128] block scales and with per-channel scales, against the experts' torch path over the dequantized
weights (layers/moe_quantized.py QuantizedExperts.reference); replayed in a CUDA graph captured with one
routing and replayed with another; with expert parallel; as GPUs below 8.9 run them (a forced target: the
weights as bytes, W8A16); on Hopper, the weights read by TMA against by pointers. Needs CUDA and triton."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (7, 5):
    pytest.skip("needs a CUDA GPU of compute capability 7.5 or more", allow_module_level=True)

from fitserve.distributed.parallel_state import TensorParallel, set_tensor_parallel  # noqa: E402
from fitserve.layers.moe_fp8 import Fp8FusedExperts  # noqa: E402
from fitserve.layers.quantization.fp8_format import Fp8Format  # noqa: E402
from tests.gpu.test_fused_moe_int4_gpu import (  # noqa: E402
    DEVICE,
    EXPERTS,
    HIDDEN,
    INTER,
    assert_a_graph_replays_another_routing,
    assert_kernels_match_the_torch_path,
    assert_ranks_sum_to_the_whole,
)

pytestmark = pytest.mark.gpu
TOKENS = (1, 8, 64, 512)  # the decode-sized tiles up to 64 tokens, the larger ones past them
FORMATS = {
    "block": Fp8Format(method="fp8", strategy="block", block=(128, 128)),
    "channel": Fp8Format(method="compressed-tensors", strategy="channel"),
}


def build(
    strategy: str, expert_parallel: tuple[int, int] | None = None, intermediate: int = INTER
) -> Fp8FusedExperts:
    rank, size = expert_parallel or (0, 1)
    set_tensor_parallel(TensorParallel(rank, size))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEVICE):
            fmt = FORMATS[strategy]
            silu = torch.nn.functional.silu
            experts = Fp8FusedExperts(
                EXPERTS, HIDDEN, intermediate, silu, fmt, "test.experts", expert_parallel is not None
            )
            experts.initialize_dummy(seed=0, std=0.05)
    finally:
        torch.set_default_dtype(previous)
        set_tensor_parallel(TensorParallel())
    return experts


@pytest.fixture(scope="module", params=list(FORMATS))
def experts(request) -> Fp8FusedExperts:
    return build(request.param)


@pytest.mark.parametrize("tokens", TOKENS)
def test_kernels_match_the_dequantized_torch_path(experts, tokens):
    assert_kernels_match_the_torch_path(experts, tokens)


def test_a_graph_replays_another_routing(experts):
    assert_a_graph_replays_another_routing(experts)


def test_expert_parallel_ranks_sum_to_the_whole():
    assert_ranks_sum_to_the_whole(build("block"), [build("block", (rank, 2)) for rank in range(2)])


@pytest.mark.parametrize("tokens", (1, 64))
def test_below_8_9_the_weights_run_as_their_bytes(experts, tokens):
    """Under a forced sm_80 target the kernels take the weights as uint8 and decode them
    (kernels/fp8_bits.py), W8A16 at every batch size, as on an A100; the reference follows."""
    from fitserve.kernels.capability import forced_target

    with forced_target((8, 0)):
        assert not experts.quantizes_activations(torch.zeros(tokens, HIDDEN, device=DEVICE))
        assert_kernels_match_the_torch_path(experts, tokens)


@pytest.mark.skipif(torch.cuda.get_device_capability() < (8, 9), reason="below 8.9 bytes either way")
@pytest.mark.parametrize("tokens", (1, 8))
def test_decoding_bytes_equals_tritons_conversion(experts, tokens, monkeypatch):
    """The W8A16 kernels (one token: moe_decode; W8A16 on the grouped kernels) give the same bits with the
    weights as bytes decoded by fp8_bits.e4m3_bytes_to_bfloat16 as with Triton's e4m3 conversion."""
    import fitserve.kernels.fp8_bits as fp8_bits
    from fitserve.kernels.fused_moe_fp8 import Fp8Experts, fused_moe_fp8
    from tests.gpu.test_fused_moe_int4_gpu import routing

    x = torch.randn(tokens, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    ids, weights = routing(tokens, seed=tokens)
    gate_up = Fp8Experts(experts.w13, experts.w13_scale, experts.group_up)
    down = Fp8Experts(experts.w2, experts.w2_scale, experts.group_down)
    act = experts.kernel_activation

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        layer = experts(x, ids, weights, reduce=False)
        return layer, fused_moe_fp8(x, gate_up, down, ids, weights, act, 0, w8a8=False)

    by_bytes = both()
    monkeypatch.setattr(fp8_bits, "BF16_FROM_BYTES", False)
    converted = both()
    assert torch.equal(by_bytes[0], converted[0])
    assert torch.equal(by_bytes[1], converted[1])


@pytest.mark.skipif(torch.cuda.get_device_capability() < (9, 0), reason="TMA weights on Hopper and up")
@pytest.mark.parametrize("intermediate", (INTER, 704))  # 704: tiles cross into the next rows
@pytest.mark.parametrize("tokens", (8, 256))
def test_tma_weights_give_the_pointer_loads_bits(intermediate, tokens, monkeypatch):
    """The swapped W8A8 kernels read the same weights through a TMA descriptor as by pointers: the same
    bits out, also where a tile's rows run past an expert's (masked at the store, as the pointer loads'
    masks leave them) and past the last expert (zeros from the copy engine)."""
    import fitserve.kernels.fused_moe_fp8 as fused_moe_fp8
    from tests.gpu.test_fused_moe_int4_gpu import routing

    experts = build("block", intermediate=intermediate)
    x = torch.randn(tokens, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    ids, weights = routing(tokens, seed=tokens)
    assert fused_moe_fp8.loads_weights_by_tma(experts.w13, swap=True)
    by_tma = experts(x, ids, weights, reduce=False)
    monkeypatch.setattr(fused_moe_fp8, "TMA_WEIGHTS", False)
    by_pointers = experts(x, ids, weights, reduce=False)
    assert torch.equal(by_tma, by_pointers)
