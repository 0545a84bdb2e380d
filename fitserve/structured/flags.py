"""--structured-outputs-config and --guided-decoding-backend: checked when the engine arguments are, so
a backend fitserve does not run stops the start, naming the choices."""

from __future__ import annotations

import json
from typing import Any

from fitserve.structured.params import BACKENDS, check_backend

# vLLM's StructuredOutputsConfig keys fitserve takes (the others change backends it does not run).
CONFIG_KEYS = ("backend",)


def check_structured_outputs_flags(config: str | dict[str, Any] | None, guided_backend: str | None) -> None:
    """ValueError naming the flag, the value and the choices for a backend fitserve does not run or a
    key it does not know."""
    check_backend(guided_backend, "--guided-decoding-backend")
    if config is None:
        return
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"--structured-outputs-config {config!r} is not JSON ({error.msg}): pass an object such as "
                '\'{"backend": "xgrammar"}\''
            ) from None
    if not isinstance(config, dict):
        raise ValueError(
            f"--structured-outputs-config {config!r} is not a JSON object: pass one such as "
            '\'{"backend": "xgrammar"}\''
        )
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"--structured-outputs-config has key(s) {unknown} fitserve does not take: it takes only "
            f"{', '.join(CONFIG_KEYS)} (one of {', '.join(BACKENDS)})"
        )
    check_backend(config.get("backend"), "--structured-outputs-config backend")
