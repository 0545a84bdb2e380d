"""Which token counts the pieces of steps with prompt tokens are captured at (worker/piecewise_graphs.py)."""

import pytest

from fitserve.capture_sizes import PIECEWISE_SIZES, piecewise_capture_sizes
from fitserve.worker.cuda_graphs import smallest_size_holding


def test_capture_sizes_follow_the_token_budget():
    assert piecewise_capture_sizes(8192) == PIECEWISE_SIZES
    assert piecewise_capture_sizes(100) == (8, 16, 32, 48, 64, 96)
    assert piecewise_capture_sizes(4) == (8,)


def test_a_step_pads_to_the_smallest_size_holding_it():
    sizes = piecewise_capture_sizes(1024)
    assert smallest_size_holding(sizes, 35, "35 tokens") == 48
    assert smallest_size_holding(sizes, 512, "512 tokens") == 512
    with pytest.raises(ValueError, match="^a step of 513 tokens exceeds the largest captured size 512$"):
        smallest_size_holding(sizes, 513, "a step of 513 tokens")
