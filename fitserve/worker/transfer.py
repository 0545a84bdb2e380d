"""Host <-> device copies that never make the host wait for the device.

A copy from pageable host memory waits until the stream is idle, which would stall the host behind the
step in flight and leave nothing to overlap. These go through pinned memory, queued in stream order;
torch's pinned-memory allocator keeps a buffer until its copy has run.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on the device, queued after the work already on the stream."""
    return tensor_to_device(torch.tensor(values, dtype=dtype), device)


def tensor_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return tensor.to(device)
    # torch.empty(pin_memory=True) + copy_ rather than tensor.pin_memory(): the latter first asks the
    # driver whether the tensor is pinned already, which costs more host time than the copy.
    staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)
    return staged.to(device, non_blocking=True)


def start_copy_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor the device fills in stream order: read it once the stream has passed this point
    (an event recorded after this call)."""
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


class PinnedStagingRing:
    """Uploads a step's host arrays with one copy: packed into a pinned buffer, copied as one block,
    handed back as device views. pin_memory() per array costs far more host time than the copies.

    The buffers rotate; an event recorded after each upload guards a buffer's reuse, so the host never
    overwrites bytes a queued copy has yet to read.
    """

    ALIGN = 16

    def __init__(self, device: torch.device, num_buffers: int = 3, initial_bytes: int = 1 << 20) -> None:
        self.device = device
        self.num_buffers = num_buffers
        on_cuda = device.type == "cuda"
        self._host = [self._new_host(initial_bytes if on_cuda else 0) for _ in range(num_buffers)]
        self._device = [torch.empty(t.numel(), dtype=torch.uint8, device=device) for t in self._host]
        self._events = [torch.cuda.Event() for _ in range(num_buffers)] if on_cuda else []
        self._recorded = [False] * num_buffers
        self._next = 0

    def _new_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Each array (int32, int64 or float32, any shape) as a tensor on the device, in order."""
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(array)) for array in arrays]
        offsets = []
        total = 0
        for array in arrays:
            offsets.append(total)
            total += -(-array.nbytes // self.ALIGN) * self.ALIGN
        index = self._next
        self._next = (index + 1) % self.num_buffers
        if self._recorded[index]:
            self._events[index].synchronize()  # long done: the buffer's copy ran steps ago
        if total > self._host[index].numel():
            size = max(total, 2 * self._host[index].numel())
            self._host[index] = self._new_host(size)
            self._device[index] = torch.empty(size, dtype=torch.uint8, device=self.device)
        host, device_buffer = self._host[index], self._device[index]
        host_bytes = host.numpy()
        for array, offset in zip(arrays, offsets):
            packed = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
            host_bytes[offset : offset + array.nbytes] = packed
        device_buffer[:total].copy_(host[:total], non_blocking=True)
        self._events[index].record()
        self._recorded[index] = True
        tensors = []
        for array, offset in zip(arrays, offsets):
            dtype = _TORCH_DTYPES[array.dtype.type]
            view = device_buffer[offset : offset + array.nbytes].view(dtype)
            tensors.append(view.view(array.shape))
        return tensors


_TORCH_DTYPES = {np.int32: torch.int32, np.int64: torch.int64, np.float32: torch.float32}
