"""`fitserve plan [MODEL] [engine flags] [--assume-gpus NxGiB[@SM]] [--json]` and `fitserve doctor [MODEL]`.

fitserve/cli/main.py adds the subcommands with `add_plan_parser` / `add_doctor_parser` and runs them with
`run_plan` / `run_doctor`. Both accept every engine flag and --config FILE.yaml; the plan is made from
config.json and the weights' headers, never by loading or converting a weight, by the same
`plan_settings` that resolves the engine's config (fitserve/planner/resolve.py).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from fitserve.args import EngineArgs, add_engine_args
from fitserve.cli.common import add_model_positional
from fitserve.planner.fit import PlanError
from fitserve.planner.hardware import probe_gpus, probe_host
from fitserve.planner.resolve import PlanRequest, plan_settings
from fitserve.server.args import add_server_args


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan",
        help="Show how the model fits this machine (or --assume-gpus) without loading it.",
        description="Plan memory before loading: weights, activations, CUDA graphs, KV cache and the "
        "settings auto-fit picks, each with its reason. Every engine flag is accepted; explicit flags win.",
    )
    add_model_positional(parser)
    add_engine_args(parser)
    add_server_args(parser)  # a serve --config file also plans; the server flags change nothing here
    group = parser.add_argument_group("plan")
    group.add_argument(
        "--assume-gpus",
        default=None,
        metavar="NxGiB[@SM]",
        help="Plan for GPUs this machine may not have: 2x20 (two 20 GiB GPUs), 1x79.19@9.0 (one GPU of "
        "79.19 GiB, compute capability 9.0). Default: the GPUs present, else the CPU.",
    )
    group.add_argument("--json", action="store_true", help="Print the plan as one JSON object.")
    return parser


def add_doctor_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "doctor",
        help="Check this machine (Python, torch, CUDA, GPUs, RAM, /dev/shm, disk, CPU kernels) and a model's "
        "plan.",
        description="One PASS / WARN / FAIL line per check; each WARN and FAIL names its fix.",
    )
    add_model_positional(parser)
    add_engine_args(parser)
    add_server_args(parser)
    return parser


def run_plan(namespace: argparse.Namespace) -> int:
    """Prints the plan (or its JSON); a plan that cannot fit is a PlanError naming the fix."""
    try:
        result = plan_settings(
            EngineArgs.from_cli(namespace),
            PlanRequest(serving=True, planning_only=True, assume_gpus=namespace.assume_gpus),
        )
    except PlanError as error:
        if not namespace.json:
            raise
        print(json.dumps({"error": {"kind": error.kind, "message": str(error)}}, indent=2))
        return 1
    from fitserve.planner.report import plan_json, plan_text

    print(json.dumps(plan_json(result), indent=2) if namespace.json else plan_text(result))
    return 0


def run_doctor(namespace: argparse.Namespace) -> int:
    from fitserve.cli.doctor import machine_checks
    from fitserve.planner.report import plan_text

    host = probe_host()
    gpus = probe_gpus()
    args = EngineArgs.from_cli(namespace)
    utilization = args.gpu_memory_utilization if "gpu_memory_utilization" in args.explicit() else None
    checks = machine_checks(
        host, gpus, device=namespace.device, dtype=namespace.dtype, gpu_memory_utilization=utilization
    )
    for check in checks:
        print(check.line())
    failed = any(check.status == "FAIL" for check in checks)
    if namespace.model is None:
        print("(give a model, `fitserve doctor MODEL`, to check its plan too)")
        return 1 if failed else 0
    try:
        result = plan_settings(args, PlanRequest(serving=True))
    except ValueError as error:  # a PlanError, or a setting `fitserve serve` would refuse
        print(f"FAIL plan: {error}")
        return 1
    plan = result.plan
    ranks = plan.inputs.tensor_parallel_size
    per_rank = "" if ranks == 1 else f" per rank (tensor_parallel_size {ranks})"
    print(
        f"PASS plan: {result.model.name} fits: weights {plan.weights_gib_per_gpu:.2f} GiB{per_rank}, "
        f"KV cache {plan.kv_cache_tokens:,} tokens, max_model_len {plan.inputs.max_model_len:,} "
        f"({plan.max_concurrency:.1f}x concurrent)"
    )
    print(plan_text(result))
    return 1 if failed else 0
