"""Checkpoint tensors into a model's parameters, by parameter name, through each parameter's own loader
(the tensor-parallel and quantized layers split or pack what they receive), keeping count of which
parameters are complete: one packed from several checkpoint tensors (q/k/v, gate/up) once all came."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from fitserve.layers.linear import default_weight_loader


class ParameterLoads:
    def __init__(self, model: nn.Module) -> None:
        self.model_name = type(model).__name__
        self.params = dict(model.named_parameters())
        self.loaded: set[str] = set()
        self._shards: dict[str, set[Any]] = {}

    def param(self, name: str, target: str) -> nn.Parameter:
        """The parameter checkpoint tensor `name` loads into (as `target`); refused when there is none."""
        param = self.params.get(target)
        if param is None:
            raise ValueError(
                f"checkpoint tensor {name!r} matches no parameter of {self.model_name}: the checkpoint is "
                "not this architecture, or config.json does not describe it"
            )
        return param

    def load(
        self,
        name: str,
        target: str,
        tensor: torch.Tensor,
        shard_id: Any = None,
        shards: Collection[Any] = (),
        param: nn.Parameter | None = None,
    ) -> None:
        """Loads tensor `name` into `target` (shard `shard_id` of `shards`, for a packed parameter)."""
        param = self.param(name, target) if param is None else param
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor) if shard_id is None else loader(param, tensor, shard_id)
        except ValueError as error:
            raise ValueError(f"loading checkpoint tensor {name!r} into {target!r}: {error}") from error
        if shard_id is None:
            self.loaded.add(target)
            return
        seen = self._shards.setdefault(target, set())
        seen.add(shard_id)
        if seen >= set(shards):
            self.loaded.add(target)
