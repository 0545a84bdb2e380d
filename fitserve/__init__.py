"""fitserve: an LLM inference and serving engine that fits the model to the machine by itself."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from fitserve.args import EngineArgs
    from fitserve.core.outputs import CompletionOutput, RequestOutput
    from fitserve.core.sampling_params import SamplingParams
    from fitserve.engine.beam_search import BeamSearchParams
    from fitserve.engine.llm import LLM

_LAZY = {
    "LLM": "fitserve.engine.llm",
    "SamplingParams": "fitserve.core.sampling_params",
    "RequestOutput": "fitserve.core.outputs",
    "CompletionOutput": "fitserve.core.outputs",
    "EngineArgs": "fitserve.args",
    "BeamSearchParams": "fitserve.engine.beam_search",
}

__all__ = [
    "LLM",
    "SamplingParams",
    "BeamSearchParams",
    "RequestOutput",
    "CompletionOutput",
    "EngineArgs",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # Imported on first use so `fitserve --help` does not pay for torch and transformers.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fitserve' has no attribute {name!r}")
