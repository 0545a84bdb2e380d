"""Which token counts the pieces of steps with prompt tokens are captured at (worker/piecewise_graphs.py)."""

import pytest

from fitserve.capture_sizes import PIECEWISE_SIZES, piecewise_capture_sizes
from fitserve.worker.cuda_graphs import smallest_size_holding

H100 = 80 << 30
RTX_3080 = 20 << 30


def test_capture_sizes_follow_the_token_budget():
    assert piecewise_capture_sizes(8192, H100) == PIECEWISE_SIZES
    assert piecewise_capture_sizes(100, H100) == (8, 16, 32, 48, 64, 96)
    assert piecewise_capture_sizes(4, H100) == (8,)


def test_gpus_under_40_gib_stop_at_512_tokens():
    assert piecewise_capture_sizes(1024, RTX_3080)[-1] == 512
    assert piecewise_capture_sizes(1024, H100)[-1] == 1024
    assert piecewise_capture_sizes(256, RTX_3080)[-1] == 256


def test_a_step_pads_to_the_smallest_size_holding_it():
    sizes = piecewise_capture_sizes(1024, H100)
    assert smallest_size_holding(sizes, 35, "35 tokens") == 48
    assert smallest_size_holding(sizes, 512, "512 tokens") == 512
    assert smallest_size_holding(sizes, 513, "513 tokens") == 640
    assert smallest_size_holding(sizes, 1024, "1024 tokens") == 1024
    with pytest.raises(ValueError, match="^a step of 1025 tokens exceeds the largest captured size 1024$"):
        smallest_size_holding(sizes, 1025, "a step of 1025 tokens")


def test_padding_past_512_tokens_stays_under_a_quarter():
    sizes = piecewise_capture_sizes(8192, H100)
    assert sizes[-1] == 1024
    for tokens in range(513, 1025):
        assert smallest_size_holding(sizes, tokens, "") - tokens < tokens / 4
