"""Per-device arrival counters for kernels whose programs split one output tile's work and let the last to
arrive sum the parts (kernels/skinny_split_gemm.py, kernels/moe_decode.py): int32, zero between calls
(the last program resets its counter), allocated once per kernel family and device at its first call.

The first call must not run inside a CUDA graph capture: there the zeroing would become part of the graph
and the buffer would live in the graph's private pool. The model runner's profile run calls every decode
kernel eagerly before it captures anything; a kernel called first inside a capture is refused with the fix.
"""

from __future__ import annotations

import torch

_buffers: dict[tuple[str, torch.device], torch.Tensor] = {}


def device_counters(owner: str, device: torch.device, slots: int) -> torch.Tensor:
    """`owner`'s `slots` counters on `device` (each family has its own, so two families' tiles never share
    a counter)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    counters = _buffers.get((owner, device))
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{owner}'s first call on {device} ran inside a CUDA graph capture, where its split counters "
                "cannot be zeroed: call it once before capturing (as the model runner's profile run does)"
            )
        counters = _buffers[(owner, device)] = torch.zeros(slots, dtype=torch.int32, device=device)
    return counters
