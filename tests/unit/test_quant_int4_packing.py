"""The packing of tests/quant_checkpoints.py and fitserve's unpacking (layers/quantization/int4_formats.py)
checked against independent decoders: compressed-tensors' own pack / unpack / dequantize functions where
the package imports, and a bit-by-bit decoder written here from each format's specification."""

from __future__ import annotations

import pytest
import torch

from fitserve.layers.quantization.int4_formats import AWQ_ORDER, pack_zero_point_rows, to_int4_weight
from fitserve.layers.quantization.int4_weight import Int4Weight, dequantize
from fitserve.layers.quantization.quant_config import Int4Format
from tests.quant_checkpoints import QuantSpec, pack_tensors, round_to_int4

OUT, IN = 48, 128


def rounded(spec: QuantSpec, seed: int = 0):
    weight = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(seed)) / 10
    return round_to_int4(weight, spec, seed)


def nibble(word: int, index: int) -> int:
    return (word >> (4 * index)) & 0xF


def decode_by_bits(spec: QuantSpec, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """w [OUT, IN] read one element at a time, straight from the format's description."""
    out = torch.empty(OUT, IN)
    group = IN if spec.group_size == -1 else spec.group_size
    for n in range(OUT):
        for k in range(IN):
            if spec.fmt in ("gptq", "gptq_v2"):
                g = int(tensors["g_idx"][k])
                code = nibble(int(tensors["qweight"][k // 8, n]), k % 8)
                zero = (nibble(int(tensors["qzeros"][g, n // 8]), n % 8) + (spec.fmt == "gptq")) & 0xF
                scale = float(tensors["scales"][g, n])
            else:  # awq: row n sits at nibble AWQ_ORDER.index(n % 8)
                g = k // group
                code = nibble(int(tensors["qweight"][k, n // 8]), AWQ_ORDER.index(n % 8))
                zero = nibble(int(tensors["qzeros"][g, n // 8]), AWQ_ORDER.index(n % 8))
                scale = float(tensors["scales"][g, n])
            out[n, k] = (code - zero) * scale
    return out


@pytest.mark.parametrize(
    "spec",
    [
        QuantSpec("gptq", 32, sym=False, act_order=True),
        QuantSpec("gptq", -1),
        QuantSpec("awq", 64, sym=False),
    ],
    ids=lambda spec: spec.name,
)
def test_gptq_and_awq_match_a_bit_by_bit_decoder(spec) -> None:
    weight = rounded(spec)
    weight.zeros[0, 0] = 0  # GPTQ v1 stores z - 1 = -1 as 15 in its 4 bits
    tensors = pack_tensors(weight, spec)
    reference = weight.dequantized()
    assert torch.equal(decode_by_bits(spec, tensors), reference)
    fmt = Int4Format(
        spec.fmt, spec.fmt, spec.group_size, spec.sym, spec.act_order, zero_offset=int(spec.fmt == "gptq")
    )
    loaded = {name: value.float() if name == "scales" else value for name, value in tensors.items()}
    assert torch.equal(dequantize(to_int4_weight(fmt, loaded, IN, "layer")), reference)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [32, -1])
def test_compressed_tensors_agrees_with_its_library(sym, group_size) -> None:
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

    spec = QuantSpec("ct", group_size, sym=sym)
    weight = rounded(spec, seed=1)
    tensors = pack_tensors(weight, spec)
    signed = (weight.codes - 8).to(torch.int8)
    assert torch.equal(tensors["weight_packed"], helpers.pack_to_int32(signed, 4))
    zero_point = (weight.zeros - 8).to(torch.int8)
    if not sym:
        assert torch.equal(tensors["weight_zero_point"], helpers.pack_to_int32(zero_point, 4, packed_dim=0))
        assert torch.equal(pack_zero_point_rows(zero_point), tensors["weight_zero_point"])
    # the library's own unpack and dequantize of these tensors give the reference
    unpacked = helpers.unpack_from_int32(tensors["weight_packed"], 4, torch.Size([OUT, IN]))
    args = QuantizationArgs(
        num_bits=4,
        type="int",
        symmetric=sym,
        strategy="channel" if group_size == -1 else "group",
        group_size=None if group_size == -1 else group_size,
    )
    library = ct_dequantize(unpacked, tensors["weight_scale"].float(), None if sym else zero_point, args=args)
    assert torch.allclose(library.float(), weight.dequantized(), rtol=0, atol=1e-6)
    fmt = Int4Format("compressed-tensors", "pack-quantized", group_size, sym, False)
    ours = to_int4_weight(fmt, {**tensors, "weight_scale": tensors["weight_scale"].float()}, IN, "layer")
    assert torch.equal(dequantize(ours), weight.dequantized())


def test_dequantize_returns_the_original_column_order() -> None:
    codes = torch.randint(0, 16, (4, 64), dtype=torch.uint8)
    perm = torch.randperm(64)
    scales, zeros = torch.rand(4, 2) + 0.5, torch.randint(0, 16, (4, 2)).float()
    permuted = Int4Weight(codes, scales, zeros, 32, perm)
    plain = Int4Weight(codes, scales, zeros, 32)
    assert torch.equal(dequantize(permuted)[:, perm], dequantize(plain))
    with pytest.raises(ValueError, match="scales has shape"):
        Int4Weight(codes, scales[:, :1], zeros, 32).check()
