"""What every quantized linear method shares: its format, the layer's name for messages, the runnable
form once loaded, and the weight loaders its checkpoint parameters carry (each calls the method's
`_load(layer, name, param, loaded, shard_id)`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class QuantizedLinearMethod:
    # Whether the loaders take a tensor-parallel rank's part of each whole checkpoint tensor (tp_split.py);
    # layers/linear.py refuses tensor parallel for a method that does not. Each format's method sets it.
    splits_for_tensor_parallel = False

    def __init__(self, fmt: Any, prefix: str = "") -> None:
        self.fmt = fmt
        self.prefix = prefix  # the layer's name, for messages
        self.runnable: Any = None

    def _loader(self, layer: nn.Module, name: str) -> Any:
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            self._load(layer, name, param, loaded, shard_id)

        return load

    def _load(
        self, layer: nn.Module, name: str, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any
    ) -> None:
        raise NotImplementedError

    def _shard_rows(self, layer: nn.Module, name: str, shard_id: Any) -> tuple[int, int, str]:
        """(first row, rows, the tensor's name for messages): where checkpoint tensor `name` of shard
        `shard_id` (None: the whole layer) goes in this rank's rows; ValueError when the layer was already
        made runnable."""
        if self.runnable is not None:
            raise ValueError(f"{self.prefix}: {name} came after the layer was loaded")
        whole = (0, getattr(layer, "output_size_per_rank", layer.output_size))
        start, rows = whole if shard_id is None else layer.shard_offsets[shard_id]
        what = f"{self.prefix}.{name}" + ("" if shard_id is None else f" (shard {shard_id!r})")
        return start, rows, what
