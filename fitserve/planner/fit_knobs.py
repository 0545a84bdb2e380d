"""The batch and graph knobs auto-fit may lower when memory is short, and their starting values.

Order of sacrifice: CUDA graph sizes (then eager), then the step's token budget, then the number of
sequences; only knobs the user left unset move.
"""

from __future__ import annotations

from fitserve.args import EngineArgs
from fitserve.planner.fit_options import holds
from fitserve.planner.hardware import GiB
from fitserve.planner.memory import MemoryInputs, plan_memory, with_settings

_SHRINK_GRAPH_CAPS = (128, 64, 32, 16, 8)
_SHRINK_BATCHED_TOKENS = (4096, 2048, 1024, 512)
_SHRINK_NUM_SEQS = (128, 64, 32, 16, 8)


def initial_capture_sizes(args: EngineArgs, on_gpu: bool) -> tuple[int, ...]:
    from fitserve.args import _capture_sizes

    if not on_gpu or args.enforce_eager:
        return ()
    return capture_sizes_for(_capture_sizes(args.compilation_config), args.max_num_seqs)


def capture_sizes_for(explicit_sizes: tuple[int, ...], max_num_seqs: int) -> tuple[int, ...]:
    """The sizes the CUDA graph runner captures (worker/platforms.py): the given ones up to max_num_seqs
    (at least batch 1), or vLLM's ladder."""
    from fitserve.worker.cuda_graphs import default_capture_sizes

    if explicit_sizes:
        return tuple(size for size in explicit_sizes if size <= max_num_seqs) or (1,)
    return tuple(default_capture_sizes(max_num_seqs))


def auto_settings(args: EngineArgs, explicit: frozenset[str]) -> frozenset[str]:
    """The settings auto-fit may change: those the user did not set."""
    auto = set()
    if not args.enforce_eager and args.compilation_config is None:
        auto.add("cudagraph_capture_sizes")
    if args.max_num_batched_tokens is None:
        auto.add("max_num_batched_tokens")
    if "max_num_seqs" not in explicit:
        auto.add("max_num_seqs")
    return frozenset(auto)


def shrink_to_fit(
    inputs: MemoryInputs, needed: int, auto: frozenset[str]
) -> tuple[MemoryInputs, dict[str, str]]:
    """Lowers unset knobs (graphs, then step tokens, then sequences) until one `needed`-token request
    fits. Kept only if they leave some room for the KV cache; else the original settings return."""
    if holds(inputs, needed) is not None:
        return inputs, {}
    original, reasons = inputs, {}
    why = f"to leave the KV cache room for a {needed:,}-token request"
    freed: dict[str, int] = {}  # bytes each setting's steps freed so far
    for setting, changed in shrink_steps(inputs, auto):
        before = plan_memory(inputs).terms.total
        inputs = changed
        freed[setting] = freed.get(setting, 0) + before - plan_memory(inputs).terms.total
        reasons[setting] = f"lowered {why} (frees {freed[setting] / GiB:.2f} GiB)"
        if holds(inputs, needed) is not None:
            return inputs, reasons
    if plan_memory(inputs).free_for_kv_bytes <= 0:
        return original, {}
    return inputs, reasons


def shrink_steps(inputs: MemoryInputs, auto: frozenset[str]) -> list[tuple[str, MemoryInputs]]:
    steps: list[tuple[str, MemoryInputs]] = []
    current = inputs
    if "cudagraph_capture_sizes" in auto and current.cudagraph_capture_sizes:
        for cap in (*_SHRINK_GRAPH_CAPS, 0):
            if cap < max(current.cudagraph_capture_sizes or (0,)) or cap == 0:
                sizes = tuple(s for s in current.cudagraph_capture_sizes if s <= cap)
                current = with_settings(current, cudagraph_capture_sizes=sizes)
                steps.append(("cudagraph_capture_sizes", current))
    if "max_num_batched_tokens" in auto:
        for tokens in _SHRINK_BATCHED_TOKENS:
            if current.max_num_seqs <= tokens < current.max_num_batched_tokens:
                current = with_settings(current, max_num_batched_tokens=tokens)
                steps.append(("max_num_batched_tokens", current))
    if "max_num_seqs" in auto:
        for seqs in _SHRINK_NUM_SEQS:
            if seqs < current.max_num_seqs:
                current = with_settings(
                    current, max_num_seqs=seqs, cudagraph_capture_sizes=capped(current, seqs)
                )
                steps.append(("max_num_seqs", current))
    return steps


def display_setting(value: object) -> str:
    if isinstance(value, tuple):
        return f"sizes up to {max(value)}" if value else "none (eager)"
    return str(value)


def capped(inputs: MemoryInputs, max_num_seqs: int) -> tuple[int, ...]:
    return tuple(s for s in inputs.cudagraph_capture_sizes if s <= max_num_seqs)
