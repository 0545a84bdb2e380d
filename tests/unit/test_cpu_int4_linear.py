"""CPU weight formats of linear layers: 4-bit-group matrices packed as int4 for torch's kernel, float32
ones re-laid out, everything else left as loaded.

fitserve's C int4 kernel, preferred where it builds, is off here (FITSERVE_CPU_KERNELS=0);
tests/unit/test_cpu_int4_kernel.py covers it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fitserve.layers.cpu import int4_linear
from fitserve.layers.cpu.int4_linear import (
    DEQUANT_MIN_ROWS,
    FP16_MIN_ROWS,
    Int4CpuLinearMethod,
    dequantize_transposed,
    find_int4_groups,
    pack,
    torch_block_rows,
)
from fitserve.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)

pytestmark = pytest.mark.skipif(not int4_linear.kernel_available(), reason="no CPU int4 kernel")


@pytest.fixture(autouse=True)
def torch_int4_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FITSERVE_CPU_KERNELS", "0")


def q4_matrix(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A float32 matrix as a Q4_1 GGUF dequantizes: per 32 weights, min + step * code, code 0..15,
    with codes 0 and 15 present in every group (llama.cpp's quantizer puts them there)."""
    gen = torch.Generator().manual_seed(seed)
    groups = cols // 32
    codes = torch.randint(0, 16, (rows, groups, 32), generator=gen)
    codes[..., 0], codes[..., 1] = 0, 15
    step = (torch.rand(rows, groups, 1, generator=gen) * 0.01 + 1e-3).half().float()
    low = (-8 * step + torch.randn(rows, groups, 1, generator=gen) * 1e-3).half().float()
    return (codes * step + low).reshape(rows, cols)


def test_packed_layout_block_follows_the_cpu_torch_builds_for() -> None:
    """torch packs int4 weights in blocks of 64 rows with its AVX-512 kernels and of 32 with its AVX2
    ones; the probe must agree with the capability torch reports."""
    expected = {"AVX512": 64, "AVX2": 32}.get(torch.backends.cpu.get_cpu_capability())
    if expected is None:
        pytest.skip(f"no known block size for {torch.backends.cpu.get_cpu_capability()}")
    assert torch_block_rows() == expected


def test_recovers_and_packs_q4_groups() -> None:
    weight = q4_matrix(128, 96)
    groups = find_int4_groups(weight)
    assert groups is not None and groups.max_deviation < 2**-8
    packed, scales_and_zeros = pack(groups)
    assert packed.dtype == torch.uint8 and packed.shape == (128, 48)
    assert scales_and_zeros.shape == (3, 128, 2) and scales_and_zeros.dtype == torch.bfloat16
    # The layout read back: the dequantized weight is the codes through the (bf16) scales and zeros.
    scales, zeros = groups.torch_scales_and_zeros()
    expected = (groups.codes.float() - 8) * scales.float().repeat_interleave(32, 1)
    expected += zeros.float().repeat_interleave(32, 1)
    torch.testing.assert_close(dequantize_transposed(packed, scales_and_zeros).t(), expected)
    torch.testing.assert_close(expected, weight, atol=2**-8 * weight.abs().max().item(), rtol=0)


def test_bf16_stored_q4_groups_are_found() -> None:
    weight = q4_matrix(64, 64, seed=1).bfloat16().float()
    assert find_int4_groups(weight) is not None


@pytest.mark.parametrize(
    "weight",
    [
        torch.randn(64, 64),
        torch.randn(64, 64).bfloat16().float(),
        q4_matrix(64, 64)[:, :48],  # K not a multiple of the group size
        q4_matrix(96, 64)[:80],  # N not a multiple of the kernel's 64-row block
        q4_matrix(64, 64).index_fill(1, torch.tensor([5]), float("nan")),
    ],
    ids=["fp32", "bf16", "k", "n", "nan"],
)
def test_other_matrices_are_not_int4(weight: torch.Tensor) -> None:
    assert find_int4_groups(weight) is None


def load_merged(layer: MergedColumnParallelLinear, shards: list[torch.Tensor]) -> None:
    for index, shard in enumerate(shards):
        layer.weight_loader(layer.weight, shard, index)


def test_packed_layer_runs_int4_once_every_shard_is_loaded() -> None:
    layer = MergedColumnParallelLinear(64, [64, 128], bias=False)
    loaded_param = layer.weight  # what a model's load_weights holds while it loads
    gate, up = q4_matrix(64, 64, seed=2), q4_matrix(128, 64, seed=3)
    layer.weight_loader(layer.weight, gate, 0)
    assert isinstance(layer.linear_method, UnquantizedLinearMethod)  # half loaded: untouched
    layer.weight_loader(layer.weight, up, 1)
    assert isinstance(layer.linear_method, Int4CpuLinearMethod)
    assert layer.weight.dtype == torch.uint8
    dense = torch.cat([gate, up])
    packed_weight = dequantize_transposed(layer.weight, layer.scales_and_zeros).t()
    assert layer.fp16_weight is not None
    for rows in (1, 5, FP16_MIN_ROWS - 1, FP16_MIN_ROWS, DEQUANT_MIN_ROWS + 3):
        x = torch.randn(rows, 64)
        with torch.inference_mode():
            got = layer(x)
        assert got.dtype == torch.float32 and got.shape == (rows, 192)
        if rows < FP16_MIN_ROWS:  # the kernel multiplies the packed weights in bfloat16
            want = F.linear(x, packed_weight)
            torch.testing.assert_close(got, want, atol=1e-2 * want.abs().max().item(), rtol=0)
        else:  # the float16 copy of the loaded weights, in float32
            want = F.linear(x, dense.half().float())
            torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=0)
        want = F.linear(x, dense)  # the loaded weights: the packed ones differ by bf16 scale rounding
        torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=0)
    for param in (loaded_param, layer.weight):
        with pytest.raises(ValueError, match="already loaded and repacked"):
            layer.weight_loader(param, gate, 0)


def q4_qkv_layer_with_bias() -> tuple[QKVParallelLinear, dict[str, torch.Tensor], torch.Tensor]:
    """A qkv layer loaded with Q4 shards, then a bias: (layer, shards, bias)."""
    layer = QKVParallelLinear(64, head_dim=32, num_heads=2, num_kv_heads=1, bias=True)
    shards = {"q": q4_matrix(64, 64, seed=4), "k": q4_matrix(32, 64, seed=5), "v": q4_matrix(32, 64, seed=6)}
    for shard_id, tensor in shards.items():
        layer.weight_loader(layer.weight, tensor, shard_id)
    bias = torch.randn(128)
    layer.weight_loader(layer.bias, bias)
    return layer, shards, bias


def test_qkv_layer_with_bias_keeps_the_bias() -> None:
    layer, shards, bias = q4_qkv_layer_with_bias()
    assert isinstance(layer.linear_method, Int4CpuLinearMethod)
    x = torch.randn(3, 64)
    want = F.linear(x, torch.cat(list(shards.values())), bias)
    torch.testing.assert_close(layer(x), want, atol=2e-2 * want.abs().max().item(), rtol=0)


def test_many_rows_use_the_float16_copy_and_few_rows_the_kernel() -> None:
    """Which form a call multiplies, told apart by the values: the fp16 copy's results follow the loaded
    weights (float16 rounding only), the kernel's the bf16 scales and activations."""
    layer = RowParallelLinear(64, 128, bias=False)
    weight = q4_matrix(128, 64, seed=7)
    layer.weight_loader(layer.weight, weight)
    assert isinstance(layer.linear_method, Int4CpuLinearMethod)
    x = torch.randn(FP16_MIN_ROWS + 6, 64)
    with torch.inference_mode():
        many = layer(x)
        few = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    exact = F.linear(x, weight.double().half().double().float())
    fp16_error = (many - exact).abs().max().item()
    kernel_error = (few - exact).abs().max().item()
    assert fp16_error <= 1e-5 * exact.abs().max().item()
    assert kernel_error > 10 * fp16_error  # bf16 activations and scales: the kernel ran
    # a batch of rows matches the same rows' product with the fp16 weights however the batch is split
    with torch.inference_mode():
        halves = torch.cat([layer(x[:FP16_MIN_ROWS]), layer(x[FP16_MIN_ROWS:])])
    torch.testing.assert_close(halves[:FP16_MIN_ROWS], many[:FP16_MIN_ROWS], atol=1e-6, rtol=1e-6)


def test_fp16_copy_switch_off_keeps_the_kernel_and_the_dequantized_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(int4_linear.FP16_ENV_SWITCH, "0")
    layer = RowParallelLinear(64, 64, bias=False)
    layer.weight_loader(layer.weight, q4_matrix(64, 64, seed=8))
    assert isinstance(layer.linear_method, Int4CpuLinearMethod) and layer.fp16_weight is None
    packed_weight = dequantize_transposed(layer.weight, layer.scales_and_zeros).t()
    for rows, tolerance in ((FP16_MIN_ROWS + 2, 1e-2), (DEQUANT_MIN_ROWS, 1e-5)):
        x = torch.randn(rows, 64)
        with torch.inference_mode():
            got = layer(x)
        want = F.linear(x, packed_weight)
        torch.testing.assert_close(got, want, atol=tolerance * want.abs().max().item(), rtol=0)


def test_float32_weights_keep_their_values_in_a_transposed_layout() -> None:
    layer = RowParallelLinear(64, 32, bias=False)
    weight = torch.randn(32, 64)
    layer.weight_loader(layer.weight, weight)
    assert isinstance(layer.linear_method, UnquantizedLinearMethod)
    assert torch.equal(layer.weight, weight) and layer.weight.t().is_contiguous()
    x = torch.randn(4, 64)
    torch.testing.assert_close(layer(x), F.linear(x, weight))


def test_switch_off_keeps_q4_matrices_float(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(int4_linear.ENV_SWITCH, "0")
    layer = RowParallelLinear(64, 64, bias=False)
    weight = q4_matrix(64, 64)
    layer.weight_loader(layer.weight, weight)
    assert isinstance(layer.linear_method, UnquantizedLinearMethod) and torch.equal(layer.weight, weight)


def test_weight_viewing_a_larger_buffer_is_left_alone() -> None:
    """--cpu-offload-gb makes a layer's parameters views of one flat buffer: they keep shape and dtype."""
    layer = RowParallelLinear(64, 64, bias=False)
    flat = torch.zeros(64 * 64 + 256)
    layer.weight.data = flat[256:].view(64, 64)
    weight = q4_matrix(64, 64)
    layer.weight_loader(layer.weight, weight)
    assert isinstance(layer.linear_method, UnquantizedLinearMethod)
    assert layer.weight.data_ptr() == flat[256:].data_ptr() and torch.equal(layer.weight, weight)
