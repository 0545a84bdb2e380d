"""Python's cyclic garbage collector, paused while `fitserve serve` starts.

A start creates some 300,000 objects that live as long as the process (torch's and transformers'
modules, the model's modules, the tokenizer, the web app) and almost no garbage. With the collector on,
the allocations trigger full collections that walk all of them again: six in a warm start of the default
model on a 2-core CPU, about 0.6 s of the start's CPU time, freeing next to nothing. `fitserve serve`
pauses the collector before its first import (fitserve/cli/main.py) and the server resumes it once it is
up, after one collection and `gc.freeze()` (api_server.freeze_startup_heap), so startup garbage is
still collected once. A start that fails resumes it too.
"""

from __future__ import annotations

import gc

_paused = False


def pause() -> None:
    """Disables the collector, unless it already is (then `resume` leaves it off)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> None:
    """Enables the collector again if `pause` disabled it; otherwise changes nothing."""
    global _paused
    if _paused:
        _paused = False
        gc.enable()


def paused() -> bool:
    return _paused
