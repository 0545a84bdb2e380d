"""`fitserve plan [MODEL] [engine flags] [--assume-gpus NxGiB[@SM]] [--json]` and `fitserve doctor [MODEL]`.

fitserve/cli.py adds the subcommands with `add_plan_parser` / `add_doctor_parser` and runs them with
`run_plan` / `run_doctor`. Both accept every engine flag and --config FILE.yaml; the plan is made from
config.json and the weights' headers, never by loading or converting a weight.
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from fitserve.args import EngineArgs, add_engine_args
from fitserve.planner.fit import FitResult, PlanError, auto_fit
from fitserve.planner.hardware import DeviceSpec, cpu_device, parse_assume_gpus, probe_gpus, probe_host

# Set on the namespace by the engine flags' actions: the EngineArgs fields given on the command line.
EXPLICIT_FLAGS_DEST = "explicit_engine_flags"
_ENGINE_FIELDS = frozenset(f.name for f in fields(EngineArgs))


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    from fitserve.cli import add_model_positional, add_server_args_if_built

    parser = subparsers.add_parser(
        "plan",
        help="Show how the model fits this machine (or --assume-gpus) without loading it.",
        description="Plan memory before loading: weights, activations, CUDA graphs, KV cache and the "
        "settings auto-fit picks, each with its reason. Every engine flag is accepted; explicit flags win.",
    )
    add_model_positional(parser)
    add_engine_args(parser)
    add_server_args_if_built(parser)  # a serve --config file also plans; the server flags change nothing here
    group = parser.add_argument_group("plan")
    group.add_argument(
        "--assume-gpus",
        default=None,
        metavar="NxGiB[@SM]",
        help="Plan for GPUs this machine may not have: 2x20 (two 20 GiB GPUs), 1x79.19@9.0 (one GPU of "
        "79.19 GiB, compute capability 9.0). Default: the GPUs present, else the CPU.",
    )
    group.add_argument("--json", action="store_true", help="Print the plan as one JSON object.")
    track_explicit_flags(parser)
    return parser


def add_doctor_parser(subparsers: Any) -> argparse.ArgumentParser:
    from fitserve.cli import add_model_positional, add_server_args_if_built

    parser = subparsers.add_parser(
        "doctor",
        help="Check this machine (Python, torch, CUDA, GPUs, RAM, /dev/shm, disk, CPU kernels) and a model's "
        "plan.",
        description="One PASS / WARN / FAIL line per check; each WARN and FAIL names its fix.",
    )
    add_model_positional(parser)
    add_engine_args(parser)
    add_server_args_if_built(parser)
    track_explicit_flags(parser)
    return parser


def run_plan(namespace: argparse.Namespace) -> int:
    """Prints the plan (or its JSON); a plan that cannot fit is a PlanError naming the fix."""
    try:
        result = plan_from_namespace(namespace, planning_only=True)
    except PlanError as error:
        if not namespace.json:
            raise
        print(json.dumps({"error": {"kind": error.kind, "message": str(error)}}, indent=2))
        return 1
    from fitserve.planner.report import plan_json, plan_text

    print(json.dumps(plan_json(result), indent=2) if namespace.json else plan_text(result))
    return 0


def plan_from_namespace(
    namespace: argparse.Namespace, serving: bool = True, planning_only: bool = False
) -> FitResult:
    """The plan for these flags: for `fitserve serve` (and `plan`, `doctor`), or offline generation.

    A command that goes on to run the engine (serve, generate, doctor) first refuses what the engine
    does not run yet (`not supported yet: --tensor-parallel-size 2 ...`); `planning_only` (`fitserve
    plan`) plans those settings anyway, for GPUs given with --assume-gpus if need be."""
    from fitserve.planner.model_info import inspect_model

    args = EngineArgs.from_cli(namespace)
    args.check_ranges()
    if not planning_only:
        args._refuse_unsupported(config_key_sources(namespace))
    assume_gpus = getattr(namespace, "assume_gpus", None)
    devices, host_ram = planning_devices(args.device, assume_gpus, can_assume=planning_only)
    model = inspect_model(args.model, args.revision, args.trust_remote_code, args.load_format)
    return auto_fit(model, args, devices, explicit_engine_fields(namespace), host_ram, serving)


def run_doctor(namespace: argparse.Namespace) -> int:
    from fitserve.planner.doctor import machine_checks
    from fitserve.planner.report import plan_text

    host = probe_host()
    gpus = probe_gpus()
    explicit = explicit_engine_fields(namespace)
    utilization = namespace.gpu_memory_utilization if "gpu_memory_utilization" in explicit else None
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
        result = plan_from_namespace(namespace)
    except ValueError as error:  # a PlanError, or a setting `fitserve serve` would refuse
        print(f"FAIL plan: {error}")
        return 1
    plan = result.plan
    print(
        f"PASS plan: {result.model.name} fits: weights {plan.weights_gib_per_gpu:.2f} GiB, KV cache "
        f"{plan.kv_cache_tokens:,} tokens, max_model_len {plan.inputs.max_model_len:,} "
        f"({plan.max_concurrency:.1f}x concurrent)"
    )
    print(plan_text(result))
    return 1 if failed else 0


def planning_devices(
    device: str, assume_gpus: str | None, can_assume: bool = True
) -> tuple[tuple[DeviceSpec, ...], int | None]:
    """The devices to plan for and the host RAM available (None for assumed GPUs: the host is unknown).
    `can_assume`: the command takes --assume-gpus (only `fitserve plan` does), so a refusal may name it."""
    if assume_gpus is not None:
        if device == "cpu":
            raise ValueError("--assume-gpus plans for GPUs but --device is cpu: drop one of them")
        return parse_assume_gpus(assume_gpus), None
    host = probe_host()
    gpus = probe_gpus() if device != "cpu" else ()
    if gpus:
        return gpus, host.ram_available_bytes
    if device == "cuda":
        assume = "plan for one with --assume-gpus COUNTxGiB (e.g. 1x24), or " if can_assume else ""
        raise ValueError(
            f"device=cuda but torch sees no CUDA GPU: {assume}set --device cpu or --device auto "
            "(the torch line of `fitserve doctor` says why it sees none)"
        )
    return (cpu_device(host),), host.ram_available_bytes


def track_explicit_flags(parser: argparse.ArgumentParser) -> None:
    """Makes each engine flag record its field in the namespace when it appears on the command line."""
    parser.set_defaults(**{EXPLICIT_FLAGS_DEST: frozenset()})
    for action in parser._actions:
        if action.option_strings and action.dest in _ENGINE_FIELDS:
            action.__class__ = _recording(type(action))


@functools.cache
def _recording(action_class: type[argparse.Action]) -> type[argparse.Action]:
    def __call__(
        self: argparse.Action, parser: Any, namespace: Any, values: Any, option_string: Any = None
    ) -> None:
        action_class.__call__(self, parser, namespace, values, option_string)
        given = getattr(namespace, EXPLICIT_FLAGS_DEST, frozenset())
        setattr(namespace, EXPLICIT_FLAGS_DEST, frozenset(given) | {self.dest})

    return type(f"Recording{action_class.__name__}", (action_class,), {"__call__": __call__})


def explicit_engine_fields(namespace: argparse.Namespace) -> frozenset[str]:
    """The EngineArgs fields the user set: flags on the command line and keys of the --config file."""
    explicit = set(getattr(namespace, EXPLICIT_FLAGS_DEST, frozenset()))
    return frozenset(explicit | _config_engine_keys(namespace).keys())


def config_key_sources(namespace: argparse.Namespace) -> dict[str, str]:
    """EngineArgs field -> "the 'key' key of --config FILE", for each field the --config file set and
    the command line did not: a refusal then names the file's key, not a flag the user never typed."""
    on_command_line = getattr(namespace, EXPLICIT_FLAGS_DEST, frozenset())
    return {
        name: f"the '{key}' key of --config {namespace.config}"
        for name, key in _config_engine_keys(namespace).items()
        if name not in on_command_line
    }


def _config_engine_keys(namespace: argparse.Namespace) -> dict[str, str]:
    """EngineArgs field -> the key that sets it in the --config file ({} without one)."""
    config = getattr(namespace, "config", None)
    if not config:
        return {}
    content = yaml.safe_load(Path(config).read_text(encoding="utf-8")) or {}
    fields = {str(key).replace("-", "_"): str(key) for key in content}
    return {name: key for name, key in fields.items() if name in _ENGINE_FIELDS}
