"""`fitserve doctor` names the path each kernel family takes (issue 35): per compute capability present,
or for the generation FITSERVE_KERNEL_TARGET forces; each line follows the rule the kernels apply."""

from __future__ import annotations

import pytest

from fitserve.cli.doctor import kernel_path_checks
from fitserve.planner.hardware import parse_assume_gpus

pytest.importorskip("triton")  # the paths are read from the Triton kernel modules

from fitserve.worker.kernel_paths import kernel_paths  # noqa: E402


def test_a_turing_gpu_gets_fp16_bytes_e4m3_no_pdl_and_torch_deltanet_prefill():
    paths = dict(kernel_paths((7, 5)))
    assert paths["dtype"].startswith("float16")
    assert "64 KB" in paths["tiles"]
    assert "CUDA cores" in paths["prefill attention"] and "CUDA cores" in paths["int4 weights"]
    assert "no programmatic dependent launch" in paths["decode launches"]
    assert "e4m3 stored as its bytes" in paths["fp8 KV cache"]
    assert paths["fp8 weights"].startswith("weight-only")
    assert paths["Gated DeltaNet prefill"].startswith("torch ops")


def test_a_hopper_gpu_gets_every_fast_path():
    paths = dict(kernel_paths((9, 0)))
    assert paths["dtype"] == "bfloat16"
    assert "227 KB" in paths["tiles"]
    assert "Gluon with warpgroup MMAs" in paths["prefill attention"]
    assert "Triton on tensor cores otherwise" in paths["prefill attention"]
    assert paths["decode launches"].startswith("programmatic dependent launch")
    assert "e4m3 and e5m2 through Triton" in paths["fp8 KV cache"]
    assert paths["fp8 weights"].startswith("W8A8")
    assert paths["Gated DeltaNet prefill"] == "the chunked Triton kernel"


def test_an_ampere_a10_is_between():
    paths = dict(kernel_paths((8, 6)))
    assert paths["dtype"] == "bfloat16" and "99 KB" in paths["tiles"]
    assert "e4m3 stored as its bytes" in paths["fp8 KV cache"]
    assert paths["Gated DeltaNet prefill"] == "the chunked Triton kernel"


def test_the_doctor_checks_once_per_capability_present(monkeypatch):
    import fitserve.kernels.capability as capability

    monkeypatch.setattr(capability, "forced", lambda: None)
    gpus = [*parse_assume_gpus("2x22@7.5"), *parse_assume_gpus("1x80@9.0")]
    checks = kernel_path_checks(gpus)
    assert [c.title for c in checks] == [
        "kernel paths (compute capability 7.5)",
        "kernel paths (compute capability 9.0)",
    ]
    assert all(c.status == "PASS" for c in checks)
    assert "e4m3 stored as its bytes" in checks[0].detail and "W8A8" in checks[1].detail


def test_a_forced_target_is_shown_without_a_gpu(monkeypatch):
    import fitserve.kernels.capability as capability

    monkeypatch.setattr(capability, "forced", lambda: (7, 0))
    (check,) = kernel_path_checks([])
    assert "FITSERVE_KERNEL_TARGET forces the choices of compute capability 7.0" in check.title
    assert "96 KB" in check.detail
