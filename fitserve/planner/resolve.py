"""EngineArgs -> EngineConfig: the one way settings are resolved, for `LLM()`, `fitserve serve`,
`generate` and `bench` alike.

    args (what the user asked, and which fields they set)
      -> check the values, refuse what the engine does not run
      -> find the devices and inspect the model once (config.json and the weights' headers); an int4
         checkpoint's format, options and group size are checked here, before any weight loads
      -> auto_fit fills every setting the user left unset, each with its reason (planner/fit.py)
      -> one log line per setting, then a frozen EngineConfig holding exactly those values

`fitserve plan` stops after auto_fit (`plan_settings`): it loads and converts nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass

from fitserve.args import DTYPES, EngineArgs, generation_overrides, served_names
from fitserve.capture_sizes import decode_capture_sizes
from fitserve.config import (
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from fitserve.logger import configure_default_logging
from fitserve.planner.draft_plan import auto_mtp
from fitserve.planner.fit import FitResult, auto_fit
from fitserve.planner.hardware import DeviceSpec, cpu_device, parse_assume_gpus, probe_gpus, probe_host
from fitserve.planner.model_info import inspect_model
from fitserve.planner.quantized_checkpoint import check_quantized_checkpoint
from fitserve.spec_decode.config import parse_speculative_config

logger = logging.getLogger("fitserve")


@dataclass(frozen=True)
class PlanRequest:
    """How to plan besides the args. `serving`: `fitserve serve`'s defaults (short prefill chunks on a
    GPU), else offline generation's. `planning_only`: `fitserve plan`, which also plans settings the
    engine does not run yet, for the GPUs of `assume_gpus` if given."""

    serving: bool = False
    planning_only: bool = False
    assume_gpus: str | None = None


def plan_settings(args: EngineArgs, request: PlanRequest = PlanRequest()) -> FitResult:
    """Checks `args`, inspects the model and fills in what the user left unset; loads nothing.
    Raises ValueError (a PlanError when it is about fitting) naming the value, the limit and the fix."""
    args.check_ranges()
    if not request.planning_only:
        args.refuse_unsupported()
    parse_speculative_config(args.speculative_config)  # a bad --speculative-config stops here
    _use_hf_token(args.hf_token)
    devices, host_ram = planning_devices(args.device, request.assume_gpus, can_assume=request.planning_only)
    model = inspect_model(args.model, args.revision, args.trust_remote_code, args.load_format)
    if not request.planning_only:
        check_quantized_checkpoint(model, args.quantization)
    explicit = args.explicit()
    auto = _auto_mtp(args, model)
    if auto is not None and auto.config is not None:
        args.speculative_config = auto.config  # what engine_config_from_fit then runs
    result = auto_fit(model, args, devices, explicit, host_ram, request.serving)
    return result if auto is None else _with_choice(result, auto.choice())


def _with_choice(result: FitResult, choice) -> FitResult:
    return dataclasses.replace(result, choices=(*result.choices, choice))


def _auto_mtp(args: EngineArgs, model):
    """Auto-MTP's decision for this model and these args (planner/draft_plan.py), or None."""
    path = model.resolved.model_path if model.resolved is not None else None
    return auto_mtp(
        args.speculative_config,
        model.hf_config,
        path,
        args.tensor_parallel_size,
        args.pipeline_parallel_size,
        args.load_format,
    )


def create_engine_config(args: EngineArgs, serving: bool = False) -> EngineConfig:
    """The engine's configuration for `args`: every setting resolved once, each logged with its origin."""
    configure_default_logging()  # so the model's source and the resolved settings reach the log
    started = time.perf_counter()
    fit = plan_settings(args, PlanRequest(serving=serving))
    if fit.model.resolved is not None:
        logger.info("Model: %s", fit.model.resolved.source)
    for choice in fit.choices:
        logger.info("%s", choice.log_line())
    for note in fit.notes:
        logger.info("Plan note: %s", note)
    config = engine_config_from_fit(args, fit)
    logger.info("Resolved the model and the engine settings in %.1f s", time.perf_counter() - started)
    return config


def engine_config_from_fit(args: EngineArgs, fit: FitResult) -> EngineConfig:
    """The frozen config holding the plan's values: what the log printed is what the engine runs."""
    from fitserve.models.default_model import DEFAULT_MODEL_ID
    from fitserve.models.loader import load_hf_config
    from fitserve.models.resolve import resolve_model

    inputs = fit.plan.inputs
    device = "cuda" if inputs.on_gpu else "cpu"
    resolved = fit.model.resolved
    hf_config = fit.model.hf_config
    if resolved is None:  # a .gguf file (converted now, once) or a hub id (its weights fetched now)
        resolved = resolve_model(args.model, args.revision)
        hf_config = load_hf_config(resolved.model_path, trust_remote_code=args.trust_remote_code)
    model = ModelConfig(
        model=DEFAULT_MODEL_ID if args.model is None else args.model,
        model_path=resolved.model_path,
        model_source=resolved.source,
        tokenizer=args.tokenizer or resolved.tokenizer_path,
        hf_config=hf_config,
        dtype=DTYPES[inputs.dtype],
        max_model_len=inputs.max_model_len,
        load_format=args.load_format,
        seed=args.seed,
        trust_remote_code=args.trust_remote_code,
        generation_config=args.generation_config,
        served_model_name=served_names(args.served_model_name),
        revision=args.revision,
        cpu_offload_gb=_cpu_offload_gb(args.cpu_offload_gb, device),
        quantization=args.quantization,
        enable_expert_parallel=args.enable_expert_parallel,
        card_sampling=resolved.card_sampling,
        card_sampling_source=resolved.card_sampling_source,
        max_logprobs=args.max_logprobs,
        tokenizer_mode=args.tokenizer_mode,
        tokenizer_revision=args.tokenizer_revision,
        override_generation_config=generation_overrides(args.override_generation_config),
        mamba_cache_mode=inputs.mamba_cache_mode,  # resolved by auto_fit (planner/fit.py)
    )
    cache = CacheConfig(
        block_size=inputs.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        num_gpu_blocks_override=inputs.num_gpu_blocks_override,
        gpu_memory_utilization=inputs.gpu_memory_utilization,
        swap_space=float(args.swap_space),
        kv_cache_dtype=inputs.kv_cache_dtype,
        cpu_kv_cache_space_gib=inputs.cpu_kv_cache_space_gib,
    )
    scheduler = SchedulerConfig(
        max_num_seqs=inputs.max_num_seqs,
        max_num_batched_tokens=inputs.max_num_batched_tokens,
        max_model_len=inputs.max_model_len,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
    )
    sizes = inputs.cudagraph_capture_sizes
    return EngineConfig(
        model=model,
        cache=cache,
        scheduler=scheduler,
        parallel=ParallelConfig(  # auto-fit's tensor_parallel_size
            inputs.tensor_parallel_size,
            args.pipeline_parallel_size,
            "ray" if args.distributed_executor_backend == "ray" else "mp",
            args.disable_custom_all_reduce,
        ),
        device=DeviceConfig(device),
        compilation=CompilationConfig(
            enforce_eager=args.enforce_eager or (inputs.on_gpu and not sizes),
            cudagraph_capture_sizes=decode_capture_sizes(sizes, inputs.max_num_seqs) if sizes else (),
        ),
        quantization=args.quantization,
        disable_log_stats=args.disable_log_stats,
        speculative=parse_speculative_config(args.speculative_config),
        explicit=args.explicit(),
        choices=fit.choices,
    )


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


def _use_hf_token(token: str | bool | None) -> None:
    """--hf-token TOKEN: the hub's downloads send it (huggingface_hub reads HF_TOKEN); a bare --hf-token
    (True) or none leaves the token of `hf auth login`, as vLLM does."""
    if isinstance(token, str) and token:
        os.environ["HF_TOKEN"] = token


def _cpu_offload_gb(cpu_offload_gb: float, device: str) -> float:
    """GiB of decoder layers the loader keeps in CPU memory: as asked on CUDA; on the CPU nothing to move."""
    if device == "cpu" and cpu_offload_gb > 0:
        logger.warning(
            "cpu_offload_gb=%g is ignored on the CPU device: every weight is already in CPU memory "
            "(drop --cpu-offload-gb to silence this)",
            cpu_offload_gb,
        )
        return 0.0
    return float(cpu_offload_gb)
