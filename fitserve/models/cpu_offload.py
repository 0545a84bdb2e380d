"""--cpu-offload-gb on the model: whole decoder layers' weights stay in CPU memory and are copied to the
device right before each of those layers runs. Which layers is fitserve/offload_split.py's arithmetic,
shared with the planner.

1. `make_layers` builds the decoder layers (decoder_blocks.py). Inside the loader's `offloading(...)`
   block it moves each layer to CPU memory as soon as that layer is built, the first layers first, until
   at least cpu_offload_gb GiB are there, so the GPU never holds every weight at once. An offloaded
   layer's parameters become views of one flat host buffer per dtype; those buffers are views of a few
   large chunks of page-locked memory from torch's own pinned allocator on CUDA (plain CPU memory
   elsewhere), laid out by `HostChunks` (fitserve/offload_split.py), which keeps that allocator's
   power-of-two rounding to less than one layer per chunk.
2. The weights load into those views like into any parameter. A quantized layer (layers/quantization)
   then replaces its checkpoint tensors with the form it computes with, as buffers: `place` marks every
   module of an offloaded layer with the device it runs on (layers/quantization/placement.py), so that
   form is the GPU kernels' one, kept in CPU memory; `attach` moves such layers into new host chunks
   laid out for what they hold now and frees the old ones.
3. `CpuOffload.attach(model)` then allocates the device staging buffers once (one set per layer layout:
   parameter and buffer names, shapes and dtypes; every decoder layer of a family has the same one),
   points each offloaded tensor at its view of them, and registers a forward pre-hook per offloaded layer that
   copies the layer's host buffers into them.

Invariants. Outside a forward, an offloaded layer's parameters read the staging buffer, i.e. whichever
layer was copied in last; its own weights are `layer.host` (FlatLayout.views maps them back to names).
The staging buffers never move, and the host buffers are never written or freed after loading, so
the copy (asynchronous, host-to-device, on the current stream) is captured by a CUDA graph as a memcpy
node that re-reads the host buffer at every replay. Both need torch to see the host buffer as pinned
(a capture refuses a copy from memory it does not), and torch decides that from the start of the
tensor's storage (`is_pinned()` asks CUDA about `storage.data()`): a view of one of its own pinned
allocations always passes, whereas cudaHostRegister on the whole pages inside an ordinary allocation
does not (the storage starts before them). Being on the current stream, a layer's copy starts after
the previous offloaded layer's kernels, which read the same staging buffer, and ends before this layer's
own: one staging set serves every layer. There is no prefetch on a side stream: a decode step is bound
by the offloaded bytes crossing PCIe (~25 GB/s), about 100x slower than the same layer's compute reading
them from GPU memory, so overlapping the two would save about 1% of a step.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from fitserve.layers.quantization.placement import mark_offloaded
from fitserve.offload_split import (
    HOST_ALIGN_BYTES,
    GiB,
    HostChunks,
    offload_too_large_message,
    split_offload,
)

logger = logging.getLogger("fitserve")

_ALIGN_BYTES = HOST_ALIGN_BYTES  # each parameter's view starts at a multiple of this in its flat buffer
_ACTIVE: contextvars.ContextVar[CpuOffload | None] = contextvars.ContextVar("cpu_offload", default=None)


def make_layers(num_layers: int, build: Callable[[int], nn.Module]) -> nn.ModuleList:
    """`build(index)` for every decoder layer; inside `offloading(offload)` the first layers built go to
    CPU memory one by one, until `offload` holds what it was asked for."""
    offload = _ACTIVE.get()
    layers = nn.ModuleList()
    for index in range(num_layers):
        layer = build(index)
        if offload is not None:
            offload.place(index, layer, num_layers)
        layers.append(layer)
    return layers


@contextmanager
def offloading(offload: CpuOffload | None) -> Iterator[None]:
    """Decoder layers built in this block (by `make_layers`) are placed by `offload` (None: none move)."""
    token = _ACTIVE.set(offload)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter of a layer sits in one flat buffer per dtype: (name, dtype, offset, shape)."""

    entries: tuple[tuple[str, torch.dtype, int, torch.Size], ...]
    numel: dict[torch.dtype, int]  # elements of each dtype's buffer

    @classmethod
    def of(cls, layer: nn.Module) -> FlatLayout:
        entries = []
        numel: dict[torch.dtype, int] = {}
        for name, param in _named_tensors(layer):
            align = max(1, _ALIGN_BYTES // param.element_size())
            start = -(-numel.get(param.dtype, 0) // align) * align
            entries.append((name, param.dtype, start, param.shape))
            numel[param.dtype] = start + param.numel()
        return cls(tuple(entries), numel)

    @property
    def host_request_bytes(self) -> int:
        """The bytes `HostChunks` places for one layer of this layout: each dtype's buffer, aligned."""
        return sum(
            -(-numel * dtype.itemsize // _ALIGN_BYTES) * _ALIGN_BYTES for dtype, numel in self.numel.items()
        )

    @property
    def key(self) -> tuple:
        return tuple((name, dtype, tuple(shape)) for name, dtype, _, shape in self.entries)

    def views(self, buffers: dict[torch.dtype, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            name: buffers[dtype][start : start + shape.numel()].view(shape)
            for name, dtype, start, shape in self.entries
        }


@dataclass
class OffloadedLayer:
    index: int
    module: nn.Module
    layout: FlatLayout
    host: dict[torch.dtype, torch.Tensor]  # the layer's weights, one flat buffer per dtype
    nbytes: int  # its parameters' bytes


class CpuOffload:
    """The decoder layers kept in CPU memory for --cpu-offload-gb and the staging buffers they run from.

    The loader builds the model inside `offloading(self)`, loads the weights, then calls `attach(model)`;
    the model keeps this object as `model.cpu_offload`. On a CPU device (tests) the same mechanism runs
    with plain CPU tensors for both the host and the staging buffers.
    """

    def __init__(self, cpu_offload_gb: float, device: torch.device | str) -> None:
        self.cpu_offload_gb = cpu_offload_gb
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"  # host chunks from torch's pinned allocator
        self.layers: list[OffloadedLayer] = []
        self.staging: dict[tuple, dict[torch.dtype, torch.Tensor]] = {}
        self.num_model_layers = 0  # decoder layers built so far, offloaded or not
        self.model_layer_bytes = 0  # and their weights
        self.host_chunks: list[torch.Tensor] = []  # uint8, every offloaded layer's host buffers are views
        self._chunk_layout = HostChunks()

    @property
    def offloaded_bytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def staging_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for bufs in self.staging.values() for t in bufs.values())

    @property
    def host_bytes(self) -> int:
        """The CPU memory (page-locked on CUDA) allocated for the offloaded weights."""
        return sum(chunk.numel() for chunk in self.host_chunks)

    def place(self, index: int, layer: nn.Module, num_layers: int) -> None:
        """Called by `make_layers` as each layer is built: moves it to CPU memory while more is wanted."""
        nbytes = _tensor_bytes(layer)
        layout = FlatLayout.of(layer)
        if index == 0:  # refuse before anything moves (all layers of a family are the same size)
            split = split_offload([nbytes] * num_layers, self.cpu_offload_gb)
            # so that the host chunks are sized for every layer that will move, not one at a time
            self._chunk_layout.expected_bytes = split.num_layers * layout.host_request_bytes
        self.num_model_layers += 1
        self.model_layer_bytes += nbytes
        if self.offloaded_bytes < self.cpu_offload_gb * GiB:
            mark_offloaded(layer, self.device)  # a quantized layer repacks for the device it runs on
            self.layers.append(self._move_to_host(index, layer, layout, nbytes))

    def attach(self, model: nn.Module) -> None:
        """After the weights are loaded: staging buffers on the device, parameters pointed at them, a
        copy hook on every offloaded layer. Raises ValueError when the layers hold less than asked."""
        if self.num_model_layers == 0:
            raise ValueError(
                f"cpu_offload_gb={self.cpu_offload_gb:g}: {type(model).__name__} does not build its layers "
                "through fitserve.models.cpu_offload.make_layers, so none can be offloaded: drop "
                "--cpu-offload-gb"
            )
        if self.offloaded_bytes < self.cpu_offload_gb * GiB:
            raise ValueError(
                offload_too_large_message(self.cpu_offload_gb, self.model_layer_bytes, self.num_model_layers)
            )
        self._rehome_repacked_layers()
        with torch.inference_mode(False), torch.no_grad():
            for layer in self.layers:
                staging = self.staging.get(layer.layout.key)
                if staging is None:
                    staging = {
                        dtype: torch.empty(numel, dtype=dtype, device=self.device)
                        for dtype, numel in layer.layout.numel.items()
                    }
                    self.staging[layer.layout.key] = staging
                views = layer.layout.views(staging)
                for name, tensor in _named_tensors(layer.module):
                    tensor.data = views[name]
                layer.module.register_forward_pre_hook(_copy_in_hook(layer.host, staging))
        model.cpu_offload = self
        logger.info(
            "CPU offload (--cpu-offload-gb %g): decoder layers %s (%d of %d) keep %.2f GiB of weights in "
            "%.2f GiB of %s CPU memory (%d chunk(s)); they run from a %.2f GiB staging buffer on %s, and "
            "every forward copies their %.2f GiB host-to-device",
            self.cpu_offload_gb,
            _ranges([layer.index for layer in self.layers]),
            len(self.layers),
            self.num_model_layers,
            self.offloaded_bytes / GiB,
            self.host_bytes / GiB,
            "page-locked" if self.pinned else "plain",
            len(self.host_chunks),
            self.staging_bytes / GiB,
            self.device,
            self.offloaded_bytes / GiB,
        )

    def _move_to_host(self, index: int, layer: nn.Module, layout: FlatLayout, nbytes: int) -> OffloadedLayer:
        host = {dtype: self._host_empty(numel, dtype) for dtype, numel in layout.numel.items()}
        views = layout.views(host)
        with torch.no_grad():
            for name, tensor in _named_tensors(layer):
                views[name].copy_(tensor)  # from the device: a synchronous copy
                tensor.data = views[name]  # the device copy is freed here, before the next layer is built
        return OffloadedLayer(index, layer, layout, host, nbytes)

    def _rehome_repacked_layers(self) -> None:
        """A quantized layer replaces its checkpoint tensors with the form it computes with once loaded
        (layers/quantization: e.g. int4 repacked for the GPU kernels, kept in CPU memory because the layer
        is marked offloaded): when any offloaded layer's tensors differ from those it was built with, every
        offloaded layer moves into new host chunks laid out for what it holds now, and the old chunks
        (the checkpoint tensors' views) are freed."""
        if all(FlatLayout.of(layer.module).key == layer.layout.key for layer in self.layers):
            return
        layouts = [FlatLayout.of(layer.module) for layer in self.layers]
        self.host_chunks = []
        self._chunk_layout = HostChunks(sum(layout.host_request_bytes for layout in layouts))
        self.layers = [
            self._move_to_host(layer.index, layer.module, layout, _tensor_bytes(layer.module))
            for layer, layout in zip(self.layers, layouts, strict=True)
        ]

    def _host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer of `numel` elements, a view of a host chunk (a new one when the last is full).

        device="cpu" always: layers are built, and placed, inside the loader's `with torch.device(...)`.
        The chunk sizes are powers of two, which torch's pinned allocator does not round up.
        """
        nbytes = numel * dtype.itemsize
        chunk_index, offset = self._chunk_layout.place(nbytes)
        if chunk_index == len(self.host_chunks):
            size = self._chunk_layout.sizes[chunk_index]
            try:
                chunk = torch.empty(size, dtype=torch.uint8, device="cpu", pin_memory=self.pinned)
            except RuntimeError as error:
                raise RuntimeError(
                    f"allocating {size / GiB:.2f} GiB of page-locked CPU memory for --cpu-offload-gb "
                    f"{self.cpu_offload_gb:g} failed ({error}): lower --cpu-offload-gb, or free host RAM"
                ) from error
            self.host_chunks.append(chunk)
        return self.host_chunks[chunk_index][offset : offset + nbytes].view(dtype)


def _named_tensors(layer: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What an offloaded layer keeps in CPU memory: its parameters and buffers (a quantized layer keeps
    its runnable form as buffers)."""
    return [*layer.named_parameters(), *layer.named_buffers()]


def _tensor_bytes(layer: nn.Module) -> int:
    return sum(tensor.numel() * tensor.element_size() for _, tensor in _named_tensors(layer))


def _copy_in_hook(
    host: dict[torch.dtype, torch.Tensor], staging: dict[torch.dtype, torch.Tensor]
) -> Callable[[nn.Module, tuple], None]:
    pairs = [(staging[dtype], host[dtype]) for dtype in host]

    def copy_weights_in(module: nn.Module, args: tuple) -> None:
        for destination, source in pairs:
            destination.copy_(source, non_blocking=True)

    return copy_weights_in


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    spans: list[list[int]] = []
    for index in indices:
        if spans and index == spans[-1][1] + 1:
            spans[-1][1] = index
        else:
            spans.append([index, index])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
