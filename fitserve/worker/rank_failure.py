"""What the engine raises when a tensor-parallel rank is gone: the engine cannot go on without it."""

from __future__ import annotations


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or failed: the engine stops (the server answers 503), the message
    names the rank and the reason."""
