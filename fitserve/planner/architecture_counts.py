"""The parameters of an architecture the planner counts from config.json itself (planner/gemma4_shape.py,
planner/qwen3_5_shape.py), split as ModelShape needs them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchitectureCounts:
    linear: int  # projection matrices and experts
    other: int  # embeddings, norms, routers, layer scalars
    replicated: int  # what every tensor-parallel rank holds whole: norms, routers, scalars
    experts: int  # the experts' parameters (all of them)
    active_experts: int  # those a token runs

    @property
    def total(self) -> int:
        return self.linear + self.other

    @property
    def active(self) -> int:
        return self.total - self.experts + self.active_experts
