"""Host <-> device copies that never make the host wait for the device.

A copy from pageable host memory waits until the stream is idle, which would stall the host behind the
step in flight and leave nothing to overlap. These go through pinned memory; torch's pinned-memory
allocator keeps a buffer until its copy has run.

A step's input upload and its sampled tokens' download each run on a side stream of their own
(`copy_stream`), not on the compute stream between two steps: queued there, each waited for the copy
engine (about 7 us on an H100 from the kernel before to the copy) and then for the copy itself, twice
a step with the device otherwise idle. Aside, the upload runs while the step before computes, and the
download while the next step computes; events order them against the compute stream. (One side
stream for both would queue the next step's upload behind this step's download.)
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


UPLOADS = "uploads"
DOWNLOADS = "downloads"
_copy_streams: dict[tuple[int, str], torch.cuda.Stream] = {}


def copy_stream(device: torch.device, direction: str) -> torch.cuda.Stream:
    """The device's side stream for UPLOADS (step inputs) or DOWNLOADS (sampled tokens), made once."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), direction)
    stream = _copy_streams.get(key)
    if stream is None:
        stream = _copy_streams[key] = torch.cuda.Stream(device=key[0])
    return stream


def start_copies_to_host_aside(tensors: list[torch.Tensor | None]) -> tuple[list, torch.cuda.Event | None]:
    """Host copies of CUDA tensors made on the downloads stream once the compute stream has produced them,
    and the event to wait for before reading them; the compute stream goes on without waiting."""
    cuda = [t for t in tensors if t is not None and t.is_cuda]
    if not cuda:
        return list(tensors), None  # nothing to copy: CPU tensors are the host copies
    compute = torch.cuda.current_stream(cuda[0].device)
    aside = not torch.cuda.is_current_stream_capturing()
    stream = copy_stream(cuda[0].device, DOWNLOADS) if aside else compute
    if aside:
        stream.wait_stream(compute)
    with torch.cuda.stream(stream):
        hosts = [None if t is None else start_copy_to_host(t) for t in tensors]
        ready = torch.cuda.Event()
        ready.record(stream)
    if aside:
        for tensor in cuda:
            tensor.record_stream(stream)  # not reused by the compute stream before the copy has read it
    return hosts, ready


class PinnedStagingRing:
    """Uploads a step's host arrays with one copy: packed into a pinned buffer, copied as one block,
    handed back as device views. pin_memory() per array costs far more host time than the copies.

    The buffers rotate. The copy runs on the uploads stream, and the compute stream waits for it before
    the step's kernels; an event recorded after each copy guards the pinned buffer's reuse (the host
    never overwrites bytes a queued copy has yet to read), and one recorded on the compute stream at
    the next upload guards the device buffer's (a copy never overwrites inputs a queued step has yet to
    read: by then every kernel of the step that read them is queued).
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
        self._read = [torch.cuda.Event() for _ in range(num_buffers)] if on_cuda else []
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
        compute = torch.cuda.current_stream(self.device)
        previous = (index - 1) % self.num_buffers
        if self._recorded[previous]:  # every reader of the previous upload is queued by now
            self._read[previous].record(compute)
        if self._recorded[index]:
            self._events[index].synchronize()  # long done: the buffer's copy ran steps ago
        fresh = not self._recorded[index]
        if total > self._host[index].numel():
            size = max(total, 2 * self._host[index].numel())
            self._host[index] = self._new_host(size)
            self._device[index] = torch.empty(size, dtype=torch.uint8, device=self.device)
            fresh = True
        host, device_buffer = self._host[index], self._device[index]
        host_bytes = host.numpy()
        for array, offset in zip(arrays, offsets):
            packed = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
            host_bytes[offset : offset + array.nbytes] = packed
        aside = not torch.cuda.is_current_stream_capturing()
        stream = copy_stream(self.device, UPLOADS) if aside else compute
        if aside and fresh:
            # a device buffer just allocated on the compute stream: its memory may still be in use by
            # kernels queued there before (the caching allocator orders reuse on that stream only)
            stream.wait_stream(compute)
        elif aside:  # a buffer used before: the upload after that use recorded its readers' event
            stream.wait_event(self._read[index])
        with torch.cuda.stream(stream):
            device_buffer[:total].copy_(host[:total], non_blocking=True)
        self._events[index].record(stream)
        self._recorded[index] = True
        if aside:
            compute.wait_event(self._events[index])
        tensors = []
        for array, offset in zip(arrays, offsets):
            dtype = _TORCH_DTYPES[array.dtype.type]
            view = device_buffer[offset : offset + array.nbytes].view(dtype)
            tensors.append(view.view(array.shape))
        return tensors


_TORCH_DTYPES = {np.int32: torch.int32, np.int64: torch.int64, np.float32: torch.float32}
