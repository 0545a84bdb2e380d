"""fitserve's on-disk cache: where converted models and downloads live, and how a folder is published.

Layout under `fitserve_cache_dir()` (fitserve/paths.py: env FITSERVE_CACHE_DIR, default ~/.cache/fitserve):
  converted/<name>/   an HF-style model folder made from a GGUF file (see gguf_convert.py)
  downloads/          files fetched from PyPI (the default model's wheel)

Invariant: a folder under converted/ is complete or absent. It is written under a temporary name in
the same parent and renamed into place in one step, so an interrupted conversion leaves only a
temporary folder (removed by the next run once its process is gone), never a half-written cache.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fitserve.paths import fitserve_cache_dir

# Written last into every published folder; its presence marks the folder complete.
COMPLETE_MARKER = "fitserve_cache_entry.json"
_TEMP_INFIX = ".partial-"


def converted_models_dir() -> Path:
    return fitserve_cache_dir() / "converted"


def downloads_dir() -> Path:
    return fitserve_cache_dir() / "downloads"


def is_complete_entry(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).is_file()


@contextmanager
def publish_folder(target: Path, record: dict[str, Any]) -> Iterator[Path]:
    """Yields an empty temporary folder; on a clean exit it becomes `target` in one rename.

    `record` (plus anything the caller added to it inside the block) is written as the completion
    marker. If another process published `target` first, ours is discarded and theirs is kept. On an
    exception the temporary folder is removed and `target` is untouched.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_partials(target.parent)
    staging = target.parent / f"{target.name}{_TEMP_INFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        yield staging
        (staging / COMPLETE_MARKER).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        try:
            os.rename(staging, target)
        except OSError:
            if not is_complete_entry(target):
                raise
            shutil.rmtree(staging, ignore_errors=True)  # a concurrent run finished first
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


@contextmanager
def exclusive_lock(target: Path) -> Iterator[None]:
    """Holds an advisory lock on `<target>.lock` so concurrent starts build `target` once: the second
    waits, then finds the entry complete. Released when the holder exits or dies."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): concurrent builds stay correct through publish_folder
        yield
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "a+b") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def remove_abandoned_partials(parent: Path) -> None:
    """Removes temporary folders whose writing process no longer runs (a killed conversion)."""
    for candidate in parent.glob(f"*{_TEMP_INFIX}*"):
        pid_text = candidate.name.rsplit(_TEMP_INFIX, 1)[1].split("-", 1)[0]
        if pid_text.isdigit() and not _process_alive(int(pid_text)):
            shutil.rmtree(candidate, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
