"""Records every engine step of a `fitserve serve` process: put this folder first on PYTHONPATH and
name a file in FITSERVE_STEP_TRACE (bench_serve_gpu.py --step-trace does both for its server).

Python imports `sitecustomize` at startup. When fitserve.engine.engine is imported, Engine._launch is
wrapped to append one line per step to the file: the host's perf_counter at the launch, the step's
decode tokens, its prompt tokens and its number of requests. With asynchronous scheduling a step is
launched while the one before runs, so the time between two launches is the device's step time once
the device is the bottleneck. benchmarks/gpu/tpot_breakdown.py splits each request's TPOT with it.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import os
import sys
import time

TRACE_PATH = os.environ.get("FITSERVE_STEP_TRACE")
FLUSH_EVERY = 200


def _wrap_launch(module) -> None:
    engine_class = module.Engine
    launch = engine_class._launch
    lines: list[str] = []

    def flush() -> None:
        with open(TRACE_PATH, "a") as trace:
            trace.writelines(lines)
        lines.clear()

    def traced_launch(self, scheduler_output):
        now = time.perf_counter()
        prompt_tokens = 0
        for item in scheduler_output.scheduled:
            prompt_end = item.request.num_prompt_tokens
            prompt_tokens += max(0, min(item.start + item.num_new_tokens, prompt_end) - item.start)
        decode_tokens = scheduler_output.num_batched_tokens - prompt_tokens
        lines.append(f"{now:.6f} {decode_tokens} {prompt_tokens} {len(scheduler_output.scheduled)}\n")
        if len(lines) >= FLUSH_EVERY:
            flush()
        return launch(self, scheduler_output)

    atexit.register(flush)
    engine_class._launch = traced_launch


class _EngineImportHook(importlib.abc.MetaPathFinder):
    """Wraps the engine module right after it is executed, once."""

    def find_spec(self, name, path, target=None):
        if name != "fitserve.engine.engine":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def execute_and_wrap(module) -> None:
            execute(module)
            _wrap_launch(module)

        spec.loader.exec_module = execute_and_wrap
        return spec


if TRACE_PATH:
    sys.meta_path.insert(0, _EngineImportHook())
