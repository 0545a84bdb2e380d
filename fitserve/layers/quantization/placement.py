"""Where a quantized layer computes and where it keeps its tensors: the same device, except for a layer
that --cpu-offload-gb keeps in CPU memory (models/cpu_offload.py marks each module of it with the device
it runs on): its runnable form is the one for that device (e.g. the GPU kernels' layout), stored on the
CPU until the offload copies it in for each forward."""

from __future__ import annotations

import torch
from torch import nn

RUN_DEVICE_ATTRIBUTE = "offload_run_device"


def run_device(layer: nn.Module, home: torch.device) -> torch.device:
    """The device `layer` computes on: its offload's device when it is offloaded, else `home` (where its
    parameters are)."""
    marked = getattr(layer, RUN_DEVICE_ATTRIBUTE, None)
    return torch.device(marked) if marked is not None else home


def is_offloaded(layer: nn.Module) -> bool:
    """Whether --cpu-offload-gb keeps `layer` in CPU memory: its tensors are moved after it is made
    runnable (into host chunks, then pointed at a staging buffer), so nothing may bind their addresses."""
    return getattr(layer, RUN_DEVICE_ATTRIBUTE, None) is not None


def mark_offloaded(layer: nn.Module, device: torch.device) -> None:
    """Marks every module of an offloaded decoder layer with the device it runs on."""
    for module in layer.modules():
        setattr(module, RUN_DEVICE_ATTRIBUTE, device)
