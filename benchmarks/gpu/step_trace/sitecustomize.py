"""Records every engine step of a `fitserve serve` process: put this folder first on PYTHONPATH and
name a file in FITSERVE_STEP_TRACE (bench_serve_gpu.py --step-trace does both for its server).

Python imports `sitecustomize` at startup. When fitserve.engine.engine is imported, Engine._launch is
wrapped to append one line per step to the file: the host's perf_counter at the launch, the step's
decode tokens, its prompt tokens, its number of requests, and two device times in milliseconds from
CUDA events recorded around the launch: the step's own time on the device (from the device reaching
its first kernel to finishing its last), and the device's time between the previous step's end and
this step's start (idle waiting for the host, or work queued outside a launch).

With asynchronous scheduling a step is launched while the one before runs, so on average the time
between two launches is the device's step time once the device is the bottleneck; but each launch
also waits for the host, so single intervals jitter around it while the device stays busy. The device
columns tell the two apart. benchmarks/gpu/tpot_breakdown.py splits each request's TPOT with them.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import os
import sys
import time

TRACE_PATH = os.environ.get("FITSERVE_STEP_TRACE")
# An experiment's knob: the GIL switch interval of the traced process (Python's default is 0.005 s).
if os.environ.get("BENCH_SWITCH_INTERVAL_S"):
    sys.setswitchinterval(float(os.environ["BENCH_SWITCH_INTERVAL_S"]))
FLUSH_EVERY = 200


class _DeviceTimes:
    """CUDA events around each launch, turned into trace lines once the device has passed them."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.pending: list[tuple[str, object, object]] = []  # (line's host columns, start, end)
        self.previous_end = None

    def around(self, host_columns: str, launch):
        start = self.torch.cuda.Event(enable_timing=True)
        end = self.torch.cuda.Event(enable_timing=True)
        start.record()
        out = launch()
        end.record()
        self.pending.append((host_columns, start, end))
        return out

    def finished_lines(self, wait: bool) -> list[str]:
        """Lines of the steps the device has finished, in order (all of them when wait is true)."""
        if wait:
            self.torch.cuda.synchronize()
        lines = []
        while self.pending and self.pending[0][2].query():
            host_columns, start, end = self.pending.pop(0)
            gap = self.previous_end.elapsed_time(start) if self.previous_end is not None else 0.0
            lines.append(f"{host_columns} {start.elapsed_time(end):.4f} {gap:.4f}\n")
            self.previous_end = end
        return lines


def _wrap_launch(module) -> None:
    engine_class = module.Engine
    launch = engine_class._launch
    device_times = _DeviceTimes()
    lines: list[str] = []

    def flush(wait: bool = False) -> None:
        lines.extend(device_times.finished_lines(wait))
        with open(TRACE_PATH, "a") as trace:
            trace.writelines(lines)
        lines.clear()

    def traced_launch(self, scheduler_output, *args, **kwargs):
        now = time.perf_counter()
        prompt_tokens = 0
        for item in scheduler_output.scheduled:
            prompt_end = item.request.num_prompt_tokens
            prompt_tokens += max(0, min(item.start + item.num_new_tokens, prompt_end) - item.start)
        decode_tokens = scheduler_output.num_batched_tokens - prompt_tokens
        host_columns = f"{now:.6f} {decode_tokens} {prompt_tokens} {len(scheduler_output.scheduled)}"
        out = device_times.around(host_columns, lambda: launch(self, scheduler_output, *args, **kwargs))
        if len(device_times.pending) >= FLUSH_EVERY:
            flush()
        return out

    atexit.register(flush, True)
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
