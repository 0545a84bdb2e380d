"""Attention: the `Attention` layer, and the backend it runs on for a device type.

Backends register here by device type as (module, class) and are imported only when first asked for, so
the CPU path never imports GPU kernel code. One instance per device type serves every layer.
"""

from __future__ import annotations

import importlib

import torch

from fitserve.layers.attention.backend import AttentionBackend

# device type -> (module, class).
_BACKEND_REGISTRY: dict[str, tuple[str, str]] = {
    "cpu": ("fitserve.layers.attention.cpu_backend", "CpuAttentionBackend"),
    "cuda": ("fitserve.layers.attention.triton_backend", "TritonAttentionBackend"),
}
_backends: dict[str, AttentionBackend] = {}


def get_attention_backend(device: torch.device | str) -> AttentionBackend:
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    backend = _backends.get(device_type)
    if backend is not None:
        return backend
    if device_type not in _BACKEND_REGISTRY:
        raise ValueError(
            f"no attention backend for device type {device_type!r}: use one of {sorted(_BACKEND_REGISTRY)}"
        )
    module_name, class_name = _BACKEND_REGISTRY[device_type]
    backend = getattr(importlib.import_module(module_name), class_name)()
    _backends[device_type] = backend
    return backend


__all__ = ["AttentionBackend", "get_attention_backend"]
