"""The message for a step that ran out of device memory: what the step held, and which knob to turn.

The engine ends the requests of such a step with finish_reason "error" and this message in
`RequestOutput.error`; the other requests go on. The message names the step's size and each setting
that leaves a step more room, with its current value and a concrete value to try:

    out_of_memory_message(config, num_tokens=8192, num_seqs=37, error=torch_oom_error)

Any other failure gets a message of the same shape without torch's text (the traceback goes to the
log): `request_failure_message` for a request whose own work raised (it alone is ended),
`step_failure_message` for a step that failed as a whole (its requests are ended).
"""

from __future__ import annotations

import re

from fitserve.config import EngineConfig

# Lowering --gpu-memory-utilization by this much shrinks the KV cache by that fraction of the GPU,
# which stays free for the steps' activations.
UTILIZATION_STEP = 0.05
_SIZE = r"([\d.]+ [KMGT]?i?B)"


def out_of_memory_message(
    config: EngineConfig,
    num_tokens: int,
    num_seqs: int,
    error: BaseException,
    kv_cache_bytes: int | None = None,
) -> str:
    """One paragraph: the step, torch's numbers, that the server goes on, and the knobs to turn.
    `kv_cache_bytes`: the KV cache the engine allocated (its memory plan's), when known."""
    on_gpu = config.device.device == "cuda"
    where = "GPU memory" if on_gpu else "memory"
    head = (
        f"Out of {where} in a step of {num_tokens:,} tokens over {num_seqs} sequences "
        f"({describe_allocation_failure(error)}). The requests of that step were ended "
        '(finish_reason "error"); the server stays up, the other requests go on, and these can be retried.'
    )
    fixes = knob_suggestions(config, error, kv_cache_bytes)
    return f"{head} To give a step more room, restart with one of: {'; '.join(fixes)}."


def is_out_of_memory_message(message: str) -> bool:
    """True for a message `out_of_memory_message` made (the request can be retried as it is)."""
    return message.startswith("Out of memory") or message.startswith("Out of GPU memory")


def request_failure_message(error: BaseException) -> str:
    """For a request whose own work in a step raised: it alone was ended."""
    return (
        f"the engine could not run this request ({type(error).__name__}; the server log has the details): "
        'it was ended with finish_reason "error" and the other requests go on'
    )


def step_failure_message(error: BaseException, num_seqs: int) -> str:
    """For a step that failed as a whole: its requests were ended, the engine goes on."""
    return (
        f"an engine step over {num_seqs} sequence(s) failed ({type(error).__name__}; the server log has the "
        'details): its requests were ended with finish_reason "error", the server goes on and this request '
        "can be retried"
    )


def knob_suggestions(
    config: EngineConfig, error: BaseException | None = None, kv_cache_bytes: int | None = None
) -> list[str]:
    """Each setting that leaves a step more memory: `--flag VALUE (now CURRENT: why)`."""
    scheduler = config.scheduler
    fixes = []
    tokens = scheduler.max_num_batched_tokens
    if tokens > 1:
        half = tokens // 2
        seqs_too = f" with --max-num-seqs {half} or fewer" if half < scheduler.max_num_seqs else ""
        why = f"now {tokens}: a smaller step holds fewer activations"
        fixes.append(f"--max-num-batched-tokens {half}{seqs_too} ({why})")
    if scheduler.max_num_seqs > 1:
        fixes.append(
            f"--max-num-seqs {scheduler.max_num_seqs // 2} (now {scheduler.max_num_seqs}: fewer sequences "
            "sample at once, so the sampler's logits are smaller)"
        )
    on_gpu = config.device.device == "cuda"
    kv_fix = _smaller_kv_cache(config, kv_cache_bytes)
    if kv_fix is not None:
        fixes.append(kv_fix)
    if on_gpu and not config.compilation.enforce_eager:
        fixes.append("--enforce-eager (CUDA graphs are on: eager mode frees their memory pool)")
    reserved = _reserved_unallocated(error) if on_gpu else None
    if reserved is not None:
        fixes.append(
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the environment (torch holds "
            f"{reserved} reserved but unallocated: the memory is fragmented)"
        )
    return fixes


def _smaller_kv_cache(config: EngineConfig, kv_cache_bytes: int | None = None) -> str | None:
    """The setting that sizes the KV cache, lowered: what it gives up stays free for the steps."""
    cache = config.cache
    override = cache.num_gpu_blocks_override
    if override is not None:
        fewer = override - max(1, override // 10)
        if fewer < 2:
            return None
        why = f"now {override}: a smaller KV cache leaves memory to the steps"
        return f"--num-gpu-blocks-override {fewer} ({why})"
    if config.device.device == "cuda":
        utilization = cache.gpu_memory_utilization
        lower = round(utilization - UTILIZATION_STEP, 2)
        if lower < UTILIZATION_STEP:
            return None
        return (
            f"--gpu-memory-utilization {lower:.2f} (now {utilization:g}: the KV cache then takes "
            f"{UTILIZATION_STEP:.0%} less of the GPU and leaves that room to the steps)"
        )
    space = cache.cpu_kv_cache_space_gib
    if space is None and kv_cache_bytes is not None:  # sized automatically: what the engine allocated
        space = round(kv_cache_bytes / 2**30, 2)
    elif space is None:  # not known here: the automatic rule's size without the RAM cap
        from fitserve.cpu_kv_cache import engine_cpu_kv_cache_size

        space = round(engine_cpu_kv_cache_size(config, None).gib, 2)
    return (
        f"--cpu-kv-cache-space {space / 2:g} (now {space:g} GiB: a smaller KV cache leaves RAM to the steps)"
    )


def describe_allocation_failure(error: BaseException) -> str:
    """torch's numbers in a few words ("torch tried to allocate 2.00 GiB with 1.10 GiB of GPU 0's
    79.19 GiB free"), or the first sentence of the error when it has none."""
    text = str(error)
    wanted = re.search(r"Tried to allocate " + _SIZE, text)
    capacity = re.search(rf"GPU (\d+) has a total capacity of {_SIZE} of which {_SIZE} is free", text)
    if wanted and capacity:
        gpu, total, free = capacity.groups()
        return f"torch tried to allocate {wanted[1]} with {free} of GPU {gpu}'s {total} free"
    if wanted:
        return f"torch tried to allocate {wanted[1]}"
    first = text.strip().split("\n", 1)[0].split(". ", 1)[0].strip().rstrip(".")
    return f"{type(error).__name__}: {first[:200]}" if first else type(error).__name__


def _reserved_unallocated(error: BaseException | None) -> str | None:
    """torch's "N reserved by PyTorch but unallocated" when it is at least the allocation that failed."""
    if error is None:
        return None
    text = str(error)
    reserved = re.search(_SIZE + r" is reserved by PyTorch but unallocated", text)
    wanted = re.search(r"Tried to allocate " + _SIZE, text)
    if reserved is None or wanted is None:
        return None
    return reserved[1] if _bytes(reserved[1]) >= _bytes(wanted[1]) else None


def _bytes(size: str) -> float:
    number, unit = size.split()
    scale = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
    return float(number) * scale.get(unit, 1)
