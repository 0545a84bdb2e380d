"""Which step sizes become CUDA graphs: the one rule the planner, the config and the worker share.

Decode graphs: one per batch size of `--compilation-config '{"cudagraph_capture_sizes": [...]}'`, else
vLLM's ladder (1, 2, 4, then every 8 up to 512), in both cases only sizes up to max_num_seqs.
Pieces of steps with prompt tokens (worker/piecewise_graphs.py): a fixed ladder of token counts up to
max_num_batched_tokens (and 512 on GPUs under 40 GiB).
"""

from __future__ import annotations

import json
from typing import Any

# The --compilation-config keys fitserve reads; any other key is refused.
COMPILATION_CONFIG_KEYS = ("cudagraph_capture_sizes",)
# Token counts a step with prompt tokens is rounded up to when it runs as CUDA graph pieces: fine steps where
# padding is cheap to compute, coarser ones above (past 512 a step pads by less than a quarter of its tokens).
# Up to 1,024 tokens, the serving budget, on GPUs of LARGE_PIECES_MIN_GPU_BYTES or more: a busy server's
# steps (a prompt chunk beside 100+ decoding streams) launched eagerly, ~400 launches from Python, and in
# pieces the 8B shape served 256 clients 13-15% faster on an H100 (two runs; 128 clients within noise).
# The pieces above 512 tokens hold ~0.25 GiB more graph memory there (0.39 GiB against 0.16), which the KV
# plan reserves: on a smaller GPU that is a real share of the KV cache (6% of a 20 GiB card's under an 8B
# model), so they stop at 512 (docs/performance.md, "Serving under load"). Larger steps' GPU time hides
# their host time.
PIECEWISE_SIZES = (8, 16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024)
SMALL_GPU_MAX_PIECE = 512
LARGE_PIECES_MIN_GPU_BYTES = 40 << 30
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


def piecewise_capture_sizes(max_num_batched_tokens: int, gpu_total_bytes: int) -> tuple[int, ...]:
    """The piece sizes a step of up to max_num_batched_tokens can use (the smallest one at least), on a GPU
    of gpu_total_bytes."""
    top = max_num_batched_tokens
    if gpu_total_bytes < LARGE_PIECES_MIN_GPU_BYTES:
        top = min(top, SMALL_GPU_MAX_PIECE)
    return tuple(size for size in PIECEWISE_SIZES if size <= top) or (PIECEWISE_SIZES[0],)


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
