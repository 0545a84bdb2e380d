"""The engine's last check before it starts pipeline stages: what the planner and the flags refuse
(planner/fit_parallel.py pipeline_refusal, args_support.py), for a config built without them."""

from __future__ import annotations

from fitserve.config import EngineConfig
from fitserve.planner.fit_parallel import pipeline_refusal


def check_pipeline_parallel(config: EngineConfig) -> None:
    """ValueError naming what keeps `config` from running in pipeline stages, and the fix."""
    stages = config.parallel.pipeline_parallel_size
    model = config.model
    model_type = str(getattr(model.hf_config, "model_type", "") or "")
    refusal = pipeline_refusal(model_type, model.num_layers, stages)
    if refusal is not None:
        raise ValueError(refusal)
    combined = [
        (config.speculative is not None, "--speculative-config", "drop --speculative-config"),
        (model.enable_expert_parallel, "--enable-expert-parallel", "drop --enable-expert-parallel"),
        (model.cpu_offload_gb > 0, f"--cpu-offload-gb {model.cpu_offload_gb:g}", "drop --cpu-offload-gb"),
    ]
    for asked, flag, fix in combined:
        if asked:
            raise ValueError(
                f"not supported yet: --pipeline-parallel-size {stages} with {flag} ({fix}, or set "
                "--pipeline-parallel-size 1)"
            )
