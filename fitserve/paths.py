"""Where fitserve keeps its files on disk: one root, `fitserve_cache_dir()`, for every part that caches.

The models' cache (models/model_cache.py: converted GGUF folders, downloads) and the CPU kernels' builds
(layers/cpu/c_kernels/library.py) live under it, each in a folder of its own.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "FITSERVE_CACHE_DIR"


def fitserve_cache_dir() -> Path:
    """$FITSERVE_CACHE_DIR, else ~/.cache/fitserve, as an absolute path."""
    configured = os.environ.get(CACHE_DIR_ENV)
    root = Path(configured).expanduser() if configured else Path.home() / ".cache" / "fitserve"
    return root.resolve()
