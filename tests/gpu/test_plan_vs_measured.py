"""What `fitserve plan` predicts before loading against what the CUDA engine measures once loaded.

For the Qwen3-0.6B and Llama-3.1-8B shapes (config.json from shared/models, dummy weights, the SmolLM2
tokenizer, max_model_len 4096): the weights the planner counted are within 1% of what the engine's
profiling measured (`CudaPlatform.weights_bytes`, torch's allocated bytes after loading), and the KV
cache tokens it planned are within 3% of the blocks the engine allocated. The planned and measured
activation peaks are printed beside them.

Each model runs in its own process (this file run as a script), which plans, then loads, then prints
the numbers as JSON: nothing of one engine is left on the GPU when the next one measures.

The sampler's share of the activation peak is an upper bound: for max_num_seqs rows of bf16 logits of
each shape's vocabulary, what the sampler allocates beside them (torch's peak allocated bytes) stays
within what the planner's sampling term counts beside them (planner/memory_estimates.py,
sampling_activation_bytes), on the profile step's top_k/top_p and on every other path of the sampler's
table (worker/sampler.py): top-p rows mixed with others, penalties and logprobs, greedy rows beside
unfiltered random ones, seeded rows (torch's race), a large top_k with min_p.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: `python tests/gpu/test_plan_vs_measured.py SHAPE UTIL`
    sys.path.insert(0, str(REPO))

from fitserve.core.sampling_params import SamplingParams  # noqa: E402
from tests.paths import MODELS_DIR, SMOLLM2_TOKENIZER_DIR  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_MODEL_LEN = 4096
WEIGHTS_TOLERANCE = 0.01
KV_TOKENS_TOLERANCE = 0.03
RESULT_PREFIX = "PLAN_VS_MEASURED "


def plan_then_measure(shape: str, gpu_memory_utilization: float) -> dict[str, int]:
    """In this process: plan as `fitserve serve` does (before loading a byte), start the engine from
    the plan's settings, and read what it measured."""
    from fitserve.args import EngineArgs
    from fitserve.cli.main import parse_command
    from fitserve.engine.engine import Engine
    from fitserve.planner.resolve import PlanRequest, engine_config_from_fit, plan_settings

    argv = [
        "serve", str(MODELS_DIR / shape), "--load-format", "dummy", "--tokenizer", str(SMOLLM2_TOKENIZER_DIR),
        "--max-model-len", str(MAX_MODEL_LEN), "--gpu-memory-utilization", str(gpu_memory_utilization),
    ]  # fmt: skip
    _, _, namespace = parse_command(argv)
    args = EngineArgs.from_cli(namespace)
    fit = plan_settings(args, PlanRequest(serving=True))
    plan = fit.plan
    engine = Engine(engine_config_from_fit(args, fit))
    stats = engine.get_stats()
    return {
        "planned_weights_bytes": plan.terms.weights,
        "measured_weights_bytes": int(engine.executor.runner.platform.weights_bytes),
        "planned_kv_tokens": plan.kv_cache_tokens,
        "measured_kv_tokens": (stats.num_kv_blocks - 1) * stats.block_size,
        "planned_max_num_batched_tokens": plan.inputs.max_num_batched_tokens,
        "engine_max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
        "planned_max_num_seqs": plan.inputs.max_num_seqs,
        "engine_max_num_seqs": engine.config.scheduler.max_num_seqs,
        "planned_activation_bytes": plan.terms.activation,
        "measured_activation_bytes": engine.memory_plan.terms.activation,
    }


def _run_in_subprocess(shape: str, gpu_memory_utilization: float) -> dict[str, int]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, __file__, shape, str(gpu_memory_utilization)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert done.returncode == 0 and lines, f"{shape} failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    plan_lines = [line for line in done.stderr.splitlines() if "Plan vs measured" in line]
    print("\n".join(plan_lines))  # the engine's own term-by-term log, shown with -s or on failure
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


def _relative(planned: int, measured: int) -> float:
    return abs(planned - measured) / measured


@pytest.mark.parametrize(
    "shape, gpu_memory_utilization",
    [("qwen3-0.6b", 0.4), ("llama-3.1-8b", 0.9)],
    ids=["qwen3-0.6b", "llama-8b"],
)
def test_planned_weights_and_kv_tokens_match_the_engine(shape: str, gpu_memory_utilization: float) -> None:
    numbers = _run_in_subprocess(shape, gpu_memory_utilization)
    print(
        f"{shape}: activation peak planned {numbers['planned_activation_bytes'] / 2**30:.3f} GiB, measured "
        f"{numbers['measured_activation_bytes'] / 2**30:.3f} GiB; KV tokens planned "
        f"{numbers['planned_kv_tokens']}, measured {numbers['measured_kv_tokens']}"
    )
    # the engine ran with the settings the plan was made for
    assert numbers["engine_max_num_batched_tokens"] == numbers["planned_max_num_batched_tokens"], numbers
    assert numbers["engine_max_num_seqs"] == numbers["planned_max_num_seqs"], numbers
    weights_off = _relative(numbers["planned_weights_bytes"], numbers["measured_weights_bytes"])
    assert weights_off <= WEIGHTS_TOLERANCE, f"weights {weights_off:.2%} off the plan: {numbers}"
    kv_off = _relative(numbers["planned_kv_tokens"], numbers["measured_kv_tokens"])
    assert kv_off <= KV_TOKENS_TOLERANCE, f"KV cache tokens {kv_off:.2%} off the plan: {numbers}"


def _sampler_cases(index: int) -> dict[str, SamplingParams]:
    """Row `index`'s parameters in each case: one case per path of worker/sampler.py's memory table."""
    return {
        "profile step: top_k 50, top_p 0.9": SamplingParams(temperature=1.0, top_p=0.9, top_k=50),
        "top_p on every other row, penalties, logprobs": SamplingParams(
            temperature=0.8,
            top_p=0.9 if index % 2 else 1.0,
            repetition_penalty=1.1,
            presence_penalty=0.5,
            logprobs=5,
        ),
        "greedy beside unfiltered random rows": SamplingParams(temperature=0.0 if index % 2 else 1.0),
        "seeded rows with top_p (torch's race)": SamplingParams(
            temperature=1.0, top_p=0.9, seed=index if index % 3 == 0 else None
        ),
        "top_k 4096 and min_p": SamplingParams(temperature=1.0, top_k=4096, min_p=0.05),
    }


SAMPLER_CASES = list(_sampler_cases(0))


@pytest.mark.parametrize("case", SAMPLER_CASES)
@pytest.mark.parametrize("shape", ["qwen3-0.6b", "llama-3.1-8b"])
def test_the_sampler_peak_is_within_the_plan(shape: str, case: str) -> None:
    from fitserve.planner.memory_estimates import sampling_activation_bytes
    from fitserve.worker.sampler import Sampler, SamplingRow
    from tests.unit.planner_helpers import memory_inputs

    inputs = memory_inputs(shape, max_num_batched_tokens=1024, max_num_seqs=256)
    num_rows, vocab = inputs.max_num_seqs, inputs.shape.vocab_size
    generator = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn((num_rows, vocab), device="cuda", generator=generator).mul_(3).to(torch.bfloat16)

    def rows() -> list[SamplingRow]:
        made = []
        for index in range(num_rows):
            params = _sampler_cases(index)[case]
            own = None if params.seed is None else torch.Generator(device="cuda").manual_seed(params.seed)
            made.append(SamplingRow(params, [1, 2, 3], [4, 5], own, frozenset({2})))
        return made

    sampler = Sampler()
    sampler(logits, rows())  # kernels built and anything made once (index tables) made before measuring
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    sampler(logits, rows())
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - before
    # the plan's term beside the logits themselves (and without the step's hidden states: 0 tokens)
    planned = sampling_activation_bytes(inputs, 0, num_rows) - num_rows * vocab * logits.element_size()
    print(f"{shape}, {case}: sampler beside its logits measured {measured / 2**20:.1f} MiB, "
          f"planned {planned / 2**20:.1f} MiB")  # fmt: skip
    assert measured <= planned, f"{shape}, {case}: {measured:,} bytes measured, {planned:,} planned"


if __name__ == "__main__":
    result = plan_then_measure(sys.argv[1], float(sys.argv[2]))
    print(RESULT_PREFIX + json.dumps(result), flush=True)
