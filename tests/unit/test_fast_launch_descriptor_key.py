"""kernels/fast_launch.py's cache key for a host-side TMA descriptor (kernels/fused_moe_fp8.py passes its
weights as one on Hopper): launches that Triton could compile differently get different keys, repeats of
the same weights the same one."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from fitserve.kernels.fast_launch import specialization_key  # noqa: E402


def _descriptor(tensor: torch.Tensor, block: list[int]) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(tensor, block)


def test_same_weights_and_box_share_a_key() -> None:
    weights = torch.zeros(256, 512, dtype=torch.float8_e4m3fn)
    first = specialization_key((_descriptor(weights, [128, 128]), 7))
    assert first is not None
    assert specialization_key((_descriptor(weights, [128, 128]), 7)) == first
    other_weights = torch.ones(256, 512, dtype=torch.float8_e4m3fn)  # another tensor of the same form
    assert specialization_key((_descriptor(other_weights, [128, 128]), 7)) == first


def test_what_a_descriptor_compiles_for_changes_the_key() -> None:
    weights = torch.zeros(256, 512, dtype=torch.float8_e4m3fn)
    reference = specialization_key((_descriptor(weights, [128, 128]),))
    changed = [
        _descriptor(weights, [64, 128]),  # the box
        _descriptor(weights.view(torch.uint8), [128, 128]),  # the dtype
        _descriptor(torch.zeros(250, 512, dtype=torch.float8_e4m3fn), [128, 128]),  # rows not 16k
        TensorDescriptor.from_tensor(weights, [128, 128], padding="nan"),  # out-of-bounds fill
    ]
    for descriptor in changed:
        assert specialization_key((descriptor,)) != reference
