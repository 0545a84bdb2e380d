"""kernels/skinny_gemm.py's tile choice: half-width tiles exactly where the default tile's programs come to
just over one per SM (up to 1.25) on GPUs where it keeps one resident per SM (the measured tail, see
NARROW_CONFIG), the default everywhere else. Skipped where triton is not installed."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

H100 = (227 * 1024, 132)
A100 = (163 * 1024, 108)
RTX_3090 = (99 * 1024, 82)


@pytest.mark.parametrize(
    ("out_features", "gpu", "narrow"),
    [
        (5120, H100, True),  # Qwen3.6-27B's down / out_proj / o_proj: 160 programs
        (5312, H100, False),  # 166: past 1.25 waves
        (6144, H100, False),  # Llama-3.1-8B's qkv: 192 (measured slower narrow in the whole model)
        (4096, H100, False),  # 128 programs: one partial wave either way
        (4224, H100, False),  # 132: exactly one wave
        (8448, H100, False),  # 264: exactly two
        (10240, H100, False),  # 320: 2.4 waves
        (34816, H100, False),
        (4096, A100, True),  # 128 programs on 108 SMs
        (5120, RTX_3090, False),  # two stages fit: not the measured case
    ],
)
def test_half_width_tiles_only_for_a_short_second_wave(out_features, gpu, narrow) -> None:
    from fitserve.kernels.skinny_gemm import NARROW_CONFIG, choose_config, default_config

    shared_memory, sms = gpu
    config = choose_config(out_features, shared_memory, sms)
    assert config == (NARROW_CONFIG if narrow else default_config(shared_memory))


def test_narrow_tiles_fit_every_default_stage_budget() -> None:
    from fitserve.kernels.skinny_gemm import NARROW_CONFIG, stage_bytes

    # three stages keep two buffers: 64 KB, so three programs share an H100 SM (228 KB)
    assert (NARROW_CONFIG.num_stages - 1) * stage_bytes(NARROW_CONFIG) == 64 * 1024


@pytest.mark.parametrize(
    ("shape", "gpu_name", "to_cublas"),
    [
        ((6144, 4096), "NVIDIA H200", True),  # Llama-3.1-8B qkv: cuBLAS faster on the H200
        ((28672, 4096), "NVIDIA H200", True),  # its gate_up
        ((14336, 4096), "NVIDIA H200", True),  # gate_up at TP 2
        ((4096, 4096), "NVIDIA H200", False),  # o_proj: at most WIDE_OUT_FEATURES outputs
        ((4096, 14336), "NVIDIA H200", False),  # down_proj
        ((3072, 4096), "NVIDIA H200", False),  # qkv at TP 2
        ((8192, 28672), "NVIDIA H200", False),  # the 70B's down: K >= 3 N keeps the skinny kernel
        ((8192, 14336), "NVIDIA H200", True),  # its down at TP 2: K < 3 N
        ((5120, 8192), "NVIDIA GH200 480GB", True),  # the same HBM3e memory
        ((28672, 4096), "NVIDIA H100 80GB HBM3", False),  # the H100's end-to-end choice stays
        ((28672, 4096), "NVIDIA A100-SXM4-80GB", False),
    ],
)
def test_wide_weights_go_to_cublas_only_where_measured_faster(shape, gpu_name, to_cublas) -> None:
    from fitserve.kernels.skinny_gemm import wide_weight_to_cublas

    assert wide_weight_to_cublas(*shape, gpu_name) is to_cublas
