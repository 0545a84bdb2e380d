"""Which path each kernel family takes on a GPU of a given compute capability, in words, for `fitserve doctor`
(issue 35: the doctor names the path each kernel family takes on the GPU present).

Every line is read from the rule the kernels and layers themselves apply (kernels/capability.py's shared
memory and e4m3 gates, the PDL gate of kernels/dependent_launch.py, prefill attention's tensor-core and
sm_90 gates, the chunked DeltaNet kernel's minimum, the fp8 W8A8 minimum), so the doctor cannot say one
thing while the kernels do another. FITSERVE_KERNEL_TARGET (kernels/capability.py) shows and runs another
generation's choices on the GPU present.
"""

from __future__ import annotations

from fitserve.kernels.capability import has_e4m3_conversion, shared_memory_per_block
from fitserve.layers.quantization.fp8_compute import W8A8_MIN_CAPABILITY
from fitserve.planner.formats import BF16_MIN_CAPABILITY

DEPENDENT_LAUNCH_MIN_CAPABILITY = (9, 0)  # griddepcontrol (kernels/dependent_launch.py)
TENSOR_CORE_DOT_MIN_CAPABILITY = (8, 0)  # Triton's tl.dot on tensor cores (kernels/prefill_attention.py)


def kernel_paths(capability: tuple[int, int]) -> list[tuple[str, str]]:
    """(kernel family, the path it takes) on a GPU of `capability`."""
    # the Triton modules load with Triton only (a GPU machine has it; `fitserve doctor` on a CPU machine
    # reaches here only with FITSERVE_KERNEL_TARGET set)
    from fitserve.kernels.gated_delta_chunk import MIN_CAPABILITY as DELTANET_CHUNK_MIN_CAPABILITY
    from fitserve.kernels.prefill_attention_sm90 import CAPABILITY as SM90_PREFILL_CAPABILITY

    shared_kb = shared_memory_per_block(capability) // 1024
    tensor_cores = capability >= TENSOR_CORE_DOT_MIN_CAPABILITY
    dot = "tensor cores" if tensor_cores else "CUDA cores (Triton has no tensor-core dot below 8.0)"
    paths = [
        ("dtype", "bfloat16" if capability >= BF16_MIN_CAPABILITY else "float16 (bfloat16 is emulated)"),
        ("tiles", f"sized for {shared_kb} KB of shared memory a block"),
        ("decode attention", "Triton split-K partitions over the paged KV cache, then one merge"),
        (
            "prefill attention",
            "Gluon with warpgroup MMAs for 16-bit caches at head dims 64 and 128 without a window "
            "(kernels/prefill_attention_sm90.py), Triton on tensor cores otherwise"
            if capability == SM90_PREFILL_CAPABILITY
            else f"Triton, {dot}",
        ),
        (
            "decode launches",
            "programmatic dependent launch between the decode step's kernels"
            if capability >= DEPENDENT_LAUNCH_MIN_CAPABILITY
            else "one after another (no programmatic dependent launch below 9.0)",
        ),
        (
            "fp8 KV cache",
            "e4m3 and e5m2 through Triton's float8 conversions"
            if has_e4m3_conversion(capability)
            else "e5m2 through Triton's conversion; e4m3 stored as its bytes and converted in the kernels "
            "with integer operations (kernels/fp8_bits.py)",
        ),
        (
            "fp8 weights",
            "W8A8 checkpoints: activations quantized, one fp8 GEMM; weight-only ones: 1-byte weights "
            "streamed through the W8A16 kernel at decode"
            if capability >= W8A8_MIN_CAPABILITY
            else "weight-only: dequantized to the model dtype piecewise before each GEMM (no fp8 "
            "conversion below 8.9)",
        ),
        ("int4 weights", f"one fused Triton int4 GEMM for every int4 format (repacked at load), {dot}"),
        (
            "Gated DeltaNet prefill",
            "the chunked Triton kernel"
            if capability >= DELTANET_CHUNK_MIN_CAPABILITY
            else "torch ops (the chunked kernel's tiles need 8.0's shared memory)",
        ),
    ]
    return paths


def describe_kernel_paths(capability: tuple[int, int]) -> str:
    """The paths as one line per family, for the doctor's check."""
    return "; ".join(f"{family}: {path}" for family, path in kernel_paths(capability))
