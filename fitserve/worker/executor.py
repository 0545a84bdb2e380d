"""Executors run the model runner: in this process today; one process per GPU for tensor parallel."""

from __future__ import annotations

from fitserve.config import EngineConfig
from fitserve.core.scheduler import SchedulerOutput
from fitserve.planner.memory import MemoryPlan
from fitserve.worker.model_runner import LaunchedStep, ModelRunner


class UniprocExecutor:
    """One model runner in the engine's own process."""

    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner(config)

    def initialize_kv_cache(self) -> MemoryPlan:
        """Sizes and allocates the KV cache; returns the memory plan it was sized by."""
        plan = self.runner.size_kv_cache()
        self.runner.allocate_kv_cache(plan)
        return plan

    def launch(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        """Starts the step; its result() waits for it (see ModelRunner.launch)."""
        return self.runner.launch(scheduler_output)


def create_executor(config: EngineConfig) -> UniprocExecutor:
    if config.parallel.tensor_parallel_size > 1 or config.parallel.pipeline_parallel_size > 1:
        raise ValueError(
            "not supported yet: tensor/pipeline parallel size > 1: run with --tensor-parallel-size 1"
        )
    return UniprocExecutor(config)
