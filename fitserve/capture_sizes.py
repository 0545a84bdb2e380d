"""Which step sizes become CUDA graphs: the one rule the planner, the config and the worker share.

Decode graphs: one per batch size of `--compilation-config '{"cudagraph_capture_sizes": [...]}'`, else
vLLM's ladder (1, 2, 4, then every 8 up to 512), in both cases only sizes up to max_num_seqs.
Pieces of steps with prompt tokens (worker/piecewise_graphs.py): a fixed ladder of token counts up to
max_num_batched_tokens.
"""

from __future__ import annotations

import json
from typing import Any

# The --compilation-config keys fitserve reads; any other key is refused.
COMPILATION_CONFIG_KEYS = ("cudagraph_capture_sizes",)
# Token counts a step with prompt tokens is rounded up to when it runs as CUDA graph pieces: fine steps where
# padding is cheap to compute, coarser ones above. Beyond 512 tokens a step's GPU time outgrows its host
# time on most models, and padding would cost compute.
PIECEWISE_SIZES = (8, 16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
_LADDER_TOP = 512


def default_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's ladder: 1, 2, 4, then every 8 up to 512, capped by max_num_seqs (added when below 512)."""
    sizes = [1, 2, 4, *range(8, _LADDER_TOP + 1, 8)]
    capped = [size for size in sizes if size <= max_num_seqs]
    if max_num_seqs not in capped and max_num_seqs < _LADDER_TOP:
        capped.append(max_num_seqs)
    return tuple(sorted(capped))


def decode_capture_sizes(requested: tuple[int, ...], max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes captured: the requested ones up to max_num_seqs (at least batch 1), or the ladder."""
    if requested:
        return tuple(size for size in requested if size <= max_num_seqs) or (1,)
    return default_capture_sizes(max_num_seqs)


def piecewise_capture_sizes(max_num_batched_tokens: int) -> tuple[int, ...]:
    """The piece sizes a step of up to max_num_batched_tokens can use (the smallest one at least)."""
    return tuple(size for size in PIECEWISE_SIZES if size <= max_num_batched_tokens) or (PIECEWISE_SIZES[0],)


def parse_capture_sizes(compilation_config: str | dict[str, Any] | None) -> tuple[int, ...]:
    """--compilation-config's sizes, ascending and unique; () when it names none."""
    if compilation_config is None:
        return ()
    options = json.loads(compilation_config) if isinstance(compilation_config, str) else compilation_config
    if not isinstance(options, dict):
        raise ValueError(
            f"compilation_config={compilation_config!r} is not a JSON object: write e.g. "
            "'{\"cudagraph_capture_sizes\": [1, 2, 4, 8]}'"
        )
    unknown = sorted(set(options) - set(COMPILATION_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"not supported yet: --compilation-config key(s) {', '.join(unknown)} (fitserve reads only "
            f"{', '.join(COMPILATION_CONFIG_KEYS)}: drop the others)"
        )
    sizes = options.get("cudagraph_capture_sizes", [])
    if not isinstance(sizes, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
        raise ValueError(
            f"cudagraph_capture_sizes={sizes!r} is not a list of integers: write e.g. [1, 2, 4, 8]"
        )
    if min(sizes, default=1) < 1:
        raise ValueError(
            f"cudagraph_capture_sizes={sizes} holds {min(sizes)}, below the minimum 1: use sizes of 1 or more"
        )
    return tuple(sorted(set(sizes)))
