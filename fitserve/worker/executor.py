"""Executors run the model runner: in this process, or one process per rank for tensor and pipeline
parallel (worker/tp_executor.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fitserve.config import EngineConfig
from fitserve.core.scheduler import SchedulerOutput
from fitserve.planner.memory import MemoryPlan
from fitserve.worker.model_runner import LaunchedStep, ModelRunner

if TYPE_CHECKING:
    from fitserve.worker.tp_executor import MultiprocExecutor


class UniprocExecutor:
    """One model runner in the engine's own process."""

    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner(config)

    def initialize_kv_cache(self) -> MemoryPlan:
        """Sizes and allocates the KV cache; returns the memory plan it was sized by."""
        plan = self.runner.size_kv_cache()
        self.runner.allocate_kv_cache(plan)
        return plan

    def launch(self, scheduler_output: SchedulerOutput, defer_sampling: bool = False) -> LaunchedStep:
        """Starts the step; its result() waits for it (see ModelRunner.launch)."""
        return self.runner.launch(scheduler_output, defer_sampling)

    def shutdown(self) -> None:
        """Nothing to stop: the runner lives and goes with this process."""


def create_executor(config: EngineConfig) -> UniprocExecutor | MultiprocExecutor:
    parallel = config.parallel
    if parallel.pipeline_parallel_size > 1:
        from fitserve.worker.pipeline_support import check_pipeline_parallel

        check_pipeline_parallel(config)
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1:
        from fitserve.worker.tp_executor import MultiprocExecutor

        return MultiprocExecutor(config)
    return UniprocExecutor(config)
