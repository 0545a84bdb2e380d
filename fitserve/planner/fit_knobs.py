"""The batch and graph knobs auto-fit may lower when memory is short, and their starting values.

Order of sacrifice: CUDA graph sizes (then eager), then the step's token budget, then the number of
sequences; only knobs the user left unset move. Once one request fits, the earlier sacrifices that a later
one made needless are taken back (graphs first): a hybrid model's state slots make max_num_seqs free the
most, often enough on its own.
"""

from __future__ import annotations

from fitserve.args import EngineArgs
from fitserve.capture_sizes import decode_capture_sizes, parse_capture_sizes
from fitserve.kv_layers import cuda_graphs_unsupported
from fitserve.planner.fit_options import SHRINK_NUM_SEQS, holds
from fitserve.planner.hardware import GiB
from fitserve.planner.memory import MemoryPlan, plan_memory
from fitserve.planner.memory_inputs import MemoryInputs, with_settings

_SHRINK_GRAPH_CAPS = (128, 64, 32, 16, 8)
_SHRINK_BATCHED_TOKENS = (4096, 2048, 1024, 512)
# Token budget per step when --max-num-batched-tokens is not given. Chunked prefill is always on,
# so a prompt longer than the budget is split over steps: the budget bounds one step's work, not the
# prompt length. CPUs get a smaller step so that decodes of a running batch are not held up for long.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cuda": 8192, "cpu": 2048}
# `fitserve serve` on a GPU: short prefill chunks. A step that prefills 8,192 tokens of an 8B model takes
# ~195 ms on an H100, stalling every stream's next token and the first token of each request behind it;
# 1,024-token chunks keep such a step near 30 ms (docs/performance.md, "Serving: the prefill chunk").
SERVE_MAX_NUM_BATCHED_TOKENS = {"cuda": 1024, "cpu": 2048}


def default_max_num_batched_tokens(device: str, max_num_seqs: int, serving: bool) -> int:
    """The step's token budget when the user set none: at least max_num_seqs (one token each)."""
    table = SERVE_MAX_NUM_BATCHED_TOKENS if serving else DEFAULT_MAX_NUM_BATCHED_TOKENS
    return max(table[device], max_num_seqs)


def initial_capture_sizes(args: EngineArgs, on_gpu: bool, model_type: str = "") -> tuple[int, ...]:
    """The decode graphs' batch sizes before any shrinking: none on the CPU, with --enforce-eager, or for
    a model whose steps cannot be captured yet (kv_layers.cuda_graphs_unsupported)."""
    if not on_gpu or args.enforce_eager or cuda_graphs_unsupported(model_type):
        return ()
    return decode_capture_sizes(parse_capture_sizes(args.compilation_config), args.max_num_seqs)


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
        before = _taken(plan_memory(inputs))
        inputs = changed
        freed[setting] = freed.get(setting, 0) + before - _taken(plan_memory(inputs))
        reasons[setting] = f"lowered {why} (frees {freed[setting] / GiB:.2f} GiB)"
        if holds(inputs, needed) is not None:
            return _take_back(original, inputs, reasons, needed, why)
    if plan_memory(inputs).free_for_kv_bytes <= 0:
        return original, {}
    return inputs, reasons


def _take_back(
    original: MemoryInputs, fitted: MemoryInputs, reasons: dict[str, str], needed: int, why: str
) -> tuple[MemoryInputs, dict[str, str]]:
    """`fitted` with the sacrifices a later one made needless taken back, graphs first (they decide decode
    speed), then the step's token budget: each back to the largest of its steps at which one `needed`-token
    request still fits. Lowering max_num_seqs frees a hybrid model's state slots (tens of MiB each), which
    can free more than every earlier step together."""
    if "cudagraph_capture_sizes" in reasons:
        full = capped(original, fitted.max_num_seqs)
        for cap in sorted({max(full or (0,)), *_SHRINK_GRAPH_CAPS}, reverse=True):
            sizes = tuple(size for size in full if size <= cap)
            if len(sizes) <= len(fitted.cudagraph_capture_sizes):
                break
            if holds(with_settings(fitted, cudagraph_capture_sizes=sizes), needed) is not None:
                fitted = with_settings(fitted, cudagraph_capture_sizes=sizes)
                break
    if "max_num_batched_tokens" in reasons:
        for tokens in (original.max_num_batched_tokens, *_SHRINK_BATCHED_TOKENS):
            if tokens <= fitted.max_num_batched_tokens:
                break
            if holds(with_settings(fitted, max_num_batched_tokens=tokens), needed) is not None:
                fitted = with_settings(fitted, max_num_batched_tokens=tokens)
                break
    starts = {
        "cudagraph_capture_sizes": capped(original, fitted.max_num_seqs),  # up to the max_num_seqs kept
        "max_num_batched_tokens": original.max_num_batched_tokens,
    }
    kept = {}
    for setting, reason in reasons.items():
        if setting in starts:
            if getattr(fitted, setting) == starts[setting]:
                continue  # taken back where it started
            back = plan_memory(with_settings(fitted, **{setting: starts[setting]}))
            reason = f"lowered {why} (frees {(_taken(back) - _taken(plan_memory(fitted))) / GiB:.2f} GiB)"
        kept[setting] = reason
    return fitted, kept


def _taken(plan: MemoryPlan) -> int:
    """Bytes the plan spends before the KV cache (a hybrid model's state pool included)."""
    return plan.terms.total + plan.recurrent_state_bytes


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
        for seqs in SHRINK_NUM_SEQS:
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
