"""What fitserve's engine does with vLLM's engine flags it has no mode for: refused when running them would
change results or cannot be done here (`not supported yet: ... (fix)`), else accepted and logged once,
naming what fitserve does instead ("results are unchanged"). fitserve/args.py holds the flags."""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fitserve.args import EngineArgs

logger = logging.getLogger("fitserve.args")

# --quantization values fitserve runs: the format of an already-quantized checkpoint (layers/quantization/
# quant_config.py checks the checkpoint against them), and fp8 / bitsandbytes, which also quantize a 16-bit
# checkpoint while loading; any other value is refused here.
CHECKPOINT_QUANTIZATIONS = (
    "gptq",
    "gptq_marlin",
    "awq",
    "awq_marlin",
    "compressed-tensors",
    "auto-round",
    "inc",
    "fp8",  # an fp8 checkpoint, or a 16-bit one quantized to fp8 while loading
    "bitsandbytes",  # a bitsandbytes 4-bit checkpoint, or a 16-bit one quantized to nf4 while loading
    "bnb",
)
CLOSEST_QUANTIZATION = (
    "the closest that run are --quantization fp8 or bitsandbytes (quantized while loading), or an int4 "
    "GPTQ, AWQ, compressed-tensors or AutoRound checkpoint of the model"
)


def refuse_unsupported(args: EngineArgs) -> None:
    """Features asked for that fitserve cannot do yet stop here; none is silently ignored. A field a
    --config file set is named by its key there, not by a flag the user never typed."""
    config_keys = args.config_keys
    refusals = [  # (field, asked, flag, fix, fix when a --config key set it)
        (
            "quantization",
            args.quantization is not None and args.quantization.lower() not in CHECKPOINT_QUANTIZATIONS,
            f"--quantization {args.quantization}",
            f"drop --quantization; {CLOSEST_QUANTIZATION}",
            f"delete that key; {CLOSEST_QUANTIZATION}",
        ),
        *_pipeline_refusals(args),
        (
            "distributed_executor_backend",
            args.distributed_executor_backend is not None
            and not _local_backend(
                args.distributed_executor_backend, args.tensor_parallel_size * args.pipeline_parallel_size
            ),
            f"--distributed-executor-backend {args.distributed_executor_backend}",
            "drop it or set --distributed-executor-backend mp (processes of this host) or ray (Ray actors, "
            "on several machines too)",
            "delete that key or set it to mp (processes of this host) or ray (Ray actors, on several "
            "machines too)",
        ),
        (
            "task",
            args.task not in ("auto", "generate"),
            f"--task {args.task}",
            "fitserve serves text generation: use --task generate or drop --task",
            "fitserve serves text generation: set it to generate or delete that key",
        ),
        (
            "enable_prompt_embeds",
            args.enable_prompt_embeds,
            "--enable-prompt-embeds",
            "send prompts as text or token ids, and drop --enable-prompt-embeds",
            "send prompts as text or token ids, and delete that key",
        ),
        (
            "skip_tokenizer_init",
            args.skip_tokenizer_init,
            "--skip-tokenizer-init",
            "drop --skip-tokenizer-init: fitserve loads the model's tokenizer",
            "delete that key: fitserve loads the model's tokenizer",
        ),
        (
            "enable_lora",
            args.enable_lora,
            "--enable-lora",
            "merge the adapter into the weights, or drop --enable-lora",
            "merge the adapter into the weights, or delete that key",
        ),
        (
            "download_dir",
            args.download_dir is not None,
            f"--download-dir {args.download_dir}",
            "give --model a local folder",
            "delete that key and give --model a local folder",
        ),
        (
            "data_parallel_size",
            args.data_parallel_size > 1,
            f"--data-parallel-size {args.data_parallel_size}",
            "set --data-parallel-size 1: data parallel runs under `fitserve serve` (N engine replicas "
            "behind one server)",
            "set it to 1: data parallel runs under `fitserve serve` (N engine replicas behind one server)",
        ),
        (
            "tokenizer_mode",
            args.tokenizer_mode in ("mistral", "custom"),
            f"--tokenizer-mode {args.tokenizer_mode}",
            "set --tokenizer-mode auto (the model's Hugging Face tokenizer)",
            "set it to auto (the model's Hugging Face tokenizer)",
        ),
        (
            "config_format",
            args.config_format == "mistral",
            f"--config-format {args.config_format}",
            "set --config-format auto (the model's config.json)",
            "set it to auto (the model's config.json)",
        ),
        (
            "code_revision",
            args.code_revision is not None,
            f"--code-revision {args.code_revision}",
            "drop --code-revision: the model's code comes from --revision",
            "delete that key: the model's code comes from --revision",
        ),
        (
            "hf_overrides",
            args.hf_overrides is not None,
            "--hf-overrides",
            "edit config.json in a local copy of the model and pass that folder to --model",
            "delete that key and edit config.json in a local copy of the model",
        ),
        (
            "scheduling_policy",
            args.scheduling_policy != "fcfs",
            f"--scheduling-policy {args.scheduling_policy}",
            "set --scheduling-policy fcfs (requests run in arrival order)",
            "set it to fcfs (requests run in arrival order)",
        ),
        (
            "kv_cache_memory_bytes",
            args.kv_cache_memory_bytes is not None,
            f"--kv-cache-memory-bytes {args.kv_cache_memory_bytes}",
            "size the KV cache with --gpu-memory-utilization or --num-gpu-blocks-override",
            "delete that key; size the KV cache with gpu-memory-utilization or num-gpu-blocks-override",
        ),
        (
            "calculate_kv_scales",
            args.calculate_kv_scales and args.kv_cache_dtype != "auto",
            f"--calculate-kv-scales with --kv-cache-dtype {args.kv_cache_dtype}",
            "drop --calculate-kv-scales: the checkpoint's k/v scales (else 1.0) are used",
            "delete that key: the checkpoint's k/v scales (else 1.0) are used",
        ),
        (
            "logits_processor_pattern",
            args.logits_processor_pattern is not None,
            f"--logits-processor-pattern {args.logits_processor_pattern}",
            "drop --logits-processor-pattern: fitserve runs no logits processors sent by requests",
            "delete that key: fitserve runs no logits processors sent by requests",
        ),
    ]
    for name, asked, flag, fix, key_fix in refusals:
        if asked and config_keys and name in config_keys:
            raise ValueError(f"not supported yet: {flag}, set by {config_keys[name]} ({key_fix})")
        if asked:
            raise ValueError(f"not supported yet: {flag} ({fix})")
    _refuse_ray_without_ray(args)
    if args.enable_chunked_prefill is False:
        logger.info(
            "--no-enable-chunked-prefill: chunked prefill stays on in fitserve (it does not change results)"
        )
    for flag, note in accepted_no_ops(args):
        logger.info("%s: %s (results are unchanged)", flag, note)


def refuse_replica_combinations(args: EngineArgs) -> None:
    """`fitserve serve --data-parallel-size N` starts N engines of data_parallel_size 1 (server/api_server.py
    create_replicas), so what data parallel cannot run beside is checked here, on the arguments as given,
    before any replica starts."""
    if args.data_parallel_size <= 1:
        return
    stages = args.pipeline_parallel_size
    for asked, flag, fix in (
        (
            stages > 1,
            f"--pipeline-parallel-size {stages} with --data-parallel-size {args.data_parallel_size}",
            f"set --data-parallel-size 1 (each replica would need its own {stages} stages), or set "
            "--pipeline-parallel-size 1",
        ),
        (
            args.distributed_executor_backend == "ray",
            f"--distributed-executor-backend ray with --data-parallel-size {args.data_parallel_size}",
            "drop --distributed-executor-backend ray (the replicas' ranks run as processes of this host), or "
            "set --data-parallel-size 1",
        ),
    ):
        if asked:
            raise ValueError(f"not supported yet: {flag} ({fix})")


def _local_backend(backend: str, num_ranks: int) -> bool:
    """vLLM's executor backends fitserve's own match: mp (a process per rank on this host), ray (a Ray
    actor per rank, worker/ray_ranks.py), and uni (one process) while there is one rank."""
    return backend in ("mp", "ray") or (backend == "uni" and num_ranks == 1)


def _refuse_ray_without_ray(args: EngineArgs) -> None:
    """Ray is an optional dependency: the ray backend without it stops here, naming the fix. Only looked
    up (not imported) here."""
    if args.distributed_executor_backend != "ray" or importlib.util.find_spec("ray") is not None:
        return
    source = ""
    if args.config_keys and "distributed_executor_backend" in args.config_keys:
        source = f", set by {args.config_keys['distributed_executor_backend']}"
    raise ValueError(
        f"--distributed-executor-backend ray{source} needs Ray, which is not installed: "
        'pip install "fitserve[ray]" (or pip install ray), or drop it to run the ranks as processes of this '
        "host"
    )


def _pipeline_refusals(args: EngineArgs) -> list[tuple[str, bool, str, str, str]]:
    """--pipeline-parallel-size runs (worker/pipeline_stage.py), but not combined with these."""
    stages = args.pipeline_parallel_size
    flag = f"--pipeline-parallel-size {stages}"
    one_stage = "or set --pipeline-parallel-size 1"
    return [
        (
            "pipeline_parallel_size",
            stages > 1 and args.speculative_config is not None,
            f"{flag} with --speculative-config",
            f"drop --speculative-config (the drafters run beside a whole model), {one_stage}",
            f"delete speculative_config (the drafters run beside a whole model), {one_stage}",
        ),
        (
            "pipeline_parallel_size",
            stages > 1 and args.enable_expert_parallel,
            f"{flag} with --enable-expert-parallel",
            f"drop --enable-expert-parallel (experts then split across --tensor-parallel-size), {one_stage}",
            f"delete enable_expert_parallel (experts then split across tensor-parallel ranks), {one_stage}",
        ),
        (
            "pipeline_parallel_size",
            stages > 1 and args.cpu_offload_gb > 0,
            f"{flag} with --cpu-offload-gb {args.cpu_offload_gb}",
            f"drop --cpu-offload-gb: each stage's GPU holds only its layers; raise the stages, {one_stage}",
            f"delete cpu_offload_gb: each stage's GPU holds only its layers; raise the stages, {one_stage}",
        ),
        (
            "pipeline_parallel_size",
            stages > 1 and args.data_parallel_size > 1,
            f"{flag} with --data-parallel-size {args.data_parallel_size}",
            f"set --data-parallel-size 1 (each replica would need its own {stages} stages), {one_stage}",
            f"set data_parallel_size to 1 (each replica would need its own {stages} stages), {one_stage}",
        ),
    ]


def accepted_no_ops(args: EngineArgs) -> list[tuple[str, str]]:
    """vLLM's flags that were given and that fitserve accepts without a mode of its own: each is
    logged once at startup, naming what fitserve does instead."""
    notes = [
        (
            args.async_scheduling,
            "--async-scheduling",
            "fitserve always schedules the next step while the device runs this one",
        ),
        (
            args.preemption_mode == "swap",
            "--preemption-mode swap",
            "fitserve preempts by recompute: "
            "the preempted request's blocks are computed again, usually found in the prefix cache",
        ),
        (
            args.disable_sliding_window,
            "--disable-sliding-window",
            "fitserve attends over the whole context and keeps --max-model-len within the model's window",
        ),
        (
            args.num_scheduler_steps > 1,
            f"--num-scheduler-steps {args.num_scheduler_steps}",
            "fitserve schedules every step (vLLM V0's multi-step scheduling is gone in vLLM too)",
        ),
        (
            not args.multi_step_stream_outputs,
            "--no-multi-step-stream-outputs",
            "fitserve streams every step's tokens",
        ),
        (
            args.max_num_partial_prefills > 1 or args.max_long_partial_prefills > 1,
            f"--max-num-partial-prefills {args.max_num_partial_prefills} / --max-long-partial-prefills "
            f"{args.max_long_partial_prefills}",
            "fitserve prefills as many prompts per step as the token budget (--max-num-batched-tokens) holds",
        ),
        (
            args.max_parallel_loading_workers is not None,
            f"--max-parallel-loading-workers {args.max_parallel_loading_workers}",
            "fitserve loads the weights in one process",
        ),
        (
            args.enable_sleep_mode,
            "--enable-sleep-mode",
            "fitserve has no sleep mode; the weights and the KV cache stay in memory",
        ),
        (args.disable_cascade_attn, "--disable-cascade-attn", "fitserve has no cascade attention"),
        (
            args.distributed_executor_backend not in (None, "ray"),
            f"--distributed-executor-backend {args.distributed_executor_backend}",
            "fitserve runs one process per tensor-parallel rank on this host, as vLLM's mp backend does",
        ),
        (
            args.distributed_executor_backend == "ray"
            and args.tensor_parallel_size * args.pipeline_parallel_size == 1,
            "--distributed-executor-backend ray",
            "one rank runs in the engine's own process; Ray places ranks only with tensor or pipeline "
            "parallel",
        ),
        (
            args.calculate_kv_scales and args.kv_cache_dtype == "auto",
            "--calculate-kv-scales",
            "the KV cache is not fp8 (--kv-cache-dtype auto), so there are no scales to calculate",
        ),
    ]
    notes += [
        (
            args.enable_expert_parallel and args.tensor_parallel_size == 1,
            "--enable-expert-parallel",
            "one rank holds every expert (it splits experts across --tensor-parallel-size ranks)",
        ),
        (
            (args.max_loras, args.max_lora_rank, args.max_cpu_loras) != (1, 16, None),
            "--max-loras / --max-lora-rank / --max-cpu-loras",
            "LoRA adapters are not supported yet (--enable-lora is refused), so there are none to size",
        ),
        (
            args.model_impl != "auto",
            f"--model-impl {args.model_impl}",
            "fitserve runs its own implementation of the architecture, tested against transformers'",
        ),
        (
            args.otlp_traces_endpoint is not None,
            f"--otlp-traces-endpoint {args.otlp_traces_endpoint}",
            "fitserve exports no traces; the request log and /metrics carry the timings",
        ),
    ]
    return [(flag, note) for given, flag, note in notes if given]
