"""Programmatic dependent launch (PDL) for the decode step's kernels, on Hopper (SM 9.0) and newer.

A decode step of an 8B model at batch 1 is ~350 kernels in a CUDA graph; between two of them the GPU
idles while the next grid is launched and its first loads are in flight (~0.7 us each, 0.26 ms a
step). With PDL a kernel may be launched while the one before it is still finishing: its programs
become resident early and wait at `wait_for_previous_kernel` (griddepcontrol.wait) until the previous
grid has completed and its writes are visible. Each kernel also signals at its start that the next
one may launch (griddepcontrol.launch_dependents), so the launch of the next overlaps this one's run.

Correctness rests on one rule: every kernel launched with PDL calls `wait_for_previous_kernel` before
any of its programs writes memory, exits, or reads memory that the kernel just before it (or itself,
in another program) may write. Completion then stays transitive (a kernel cannot finish before the one
before it did), and kernels that are not launched with PDL (cuBLAS, torch's own) are ordered by the
stream as always. Before the wait a program may read what no kernel of the step writes (weights,
norm weights, the cos/sin table; the skinny GEMM asks the L2 for its weight rows there) and the step's
inputs: token positions, KV slots, context lengths and block tables are written before the forward's
first kernel (the embedding lookup, a torch kernel, so stream-ordered), and a PDL kernel starts only
once the one before it has passed its own wait, so everything two kernels back is complete. Those
reads bypass L1 (`.cg`). Moving them before the wait takes their round trips off the chain between
two kernels (an RMSNorm at batch 1 added 2.7 us to the step, now 1.4; docs/performance.md). Below SM
9.0 the instructions do not exist: kernels compile without them and launch as usual.

It speeds up single8b on an H100. Loading the skinny GEMM's first weight chunk into registers before
the wait measured slower and was left out; asking the L2 for it instead (kernels/l2_prefetch.py) pays.
Figures: docs/performance.md, sections "Programmatic dependent launch" and "Prefetching weights into
L2, and the step's tail".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitserve.kernels.capability import kernel_capability

# Off switch for comparisons (tests, benchmarks); on by default where the GPU supports it.
ENABLED = True


def pdl_kwargs(device: torch.device) -> dict[str, bool]:
    """The launch arguments of a kernel that takes USE_PDL: {"USE_PDL": ..., "launch_pdl": ...}. On when
    the capability the kernels are chosen for (kernels/capability.py: a forced target, else the GPU's)
    is 9.0 or more."""
    capability = kernel_capability(device) if ENABLED else None
    use = capability is not None and capability >= (9, 0)
    return {"USE_PDL": use, "launch_pdl": use}


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    """First statement of a PDL kernel: wait until the previous grid is done, then let the next one
    launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
