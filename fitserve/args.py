"""Engine arguments with vLLM's flag names, and their command-line flags.

`EngineArgs` holds what the user asked for, unresolved, and which fields the user set.
`fitserve.planner.create_engine_config(args)` resolves it once into the frozen `EngineConfig`, for
`LLM()`, `fitserve serve`, `generate` and `bench` alike. Each field's flag (name, type, choices, help)
is declared next to the field, so the dataclass, the flags and the YAML keys (fitserve/arg_parser.py)
cannot drift apart.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import Field, dataclass, field, fields
from typing import Any

import torch

from fitserve.arg_parser import json_object, nullable_str
from fitserve.args_explicit import (
    config_key_sources,
    explicit_engine_fields,
    record_explicit_flags,
)
from fitserve.args_support import refuse_unsupported
from fitserve.capture_sizes import parse_capture_sizes
from fitserve.config import DEFAULT_GPU_MEMORY_UTILIZATION
from fitserve.cpu_kv_cache import check_cpu_kv_cache_space
from fitserve.structured.flags import check_structured_outputs_flags

DTYPES = {
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}


def _flag(default: Any, help_text: str, **argparse_kwargs: Any) -> Any:
    return field(default=default, metadata={"help": help_text, "argparse": argparse_kwargs})


def _hf_token(value: str) -> str | bool | None:
    """--hf-token's value: a token, or true (a YAML `hf-token: true`: the login's token, as a bare flag)."""
    if value.lower() in ("true", "false"):
        return value.lower() == "true" or None
    return nullable_str(value)


_BOOL = {"action": argparse.BooleanOptionalAction}
_NO_EFFECT = "Accepted for vLLM compatibility; has no effect in fitserve"
logger = logging.getLogger(__name__)


@dataclass
class EngineArgs:
    """What the user asked for, field for field named as vLLM's engine arguments."""

    model: str | None = _flag(
        None,
        "Model: a local folder, a hub id or a .gguf file. Default: SmolLM2-135M-Instruct.",
        type=nullable_str,
    )
    tokenizer: str | None = _flag(
        None, "Tokenizer folder or hub id. Default: the model's own.", type=nullable_str
    )
    revision: str | None = _flag(
        None, "Model revision (branch, tag or commit) on the hub.", type=nullable_str
    )
    dtype: str = _flag(
        "auto",
        "Weight and activation dtype. auto: float32 on CPU (bf16 matmuls are slow on most CPUs); on CUDA the "
        "model's torch_dtype, bfloat16 for float32 models, float16 below compute capability 8.0.",
        choices=["auto", *DTYPES],
    )
    max_model_len: int | None = _flag(
        None, "Context length (prompt + output). Default: the model's own.", type=int
    )
    block_size: int = _flag(16, "Tokens per KV cache block.", type=int, choices=[1, 8, 16, 32, 64, 128])
    enable_prefix_caching: bool = _flag(True, "Reuse KV blocks of shared prompt prefixes.", **_BOOL)
    mamba_cache_mode: str = _flag(
        "align",
        "Prefix caching of hybrid models' recurrent state (Qwen3.5's DeltaNet layers). align: the state is "
        "kept where a step ends on a block boundary (prompt chunks are cut to end there), so a later "
        "request with the same prefix resumes from it; none: no hybrid prefix-cache hits; all: refused "
        "for these models (vLLM runs them in align only). Ignored for attention-only models and without "
        "prefix caching.",
        choices=["none", "align", "all"],
    )
    max_num_seqs: int = _flag(256, "Most requests running in one step.", type=int)
    max_num_batched_tokens: int | None = _flag(
        None,
        "Most tokens (prompt chunks + decodes) in one step. Chunked prefill is always on, so this may be "
        "below --max-model-len. Default: 8192 on CUDA (1024 for `fitserve serve`, for short first-token "
        "and inter-token latency), 2048 on CPU; at least --max-num-seqs.",
        type=int,
    )
    long_prefill_token_threshold: int = _flag(
        0,
        "Most prompt tokens one request computes in a step (0: no limit but the step's budget). A prompt "
        "arriving beside running streams then spreads over several cheap steps instead of stalling them "
        "all in one, while several prompts together still fill a step. Default: 0.",
        type=int,
    )
    num_gpu_blocks_override: int | None = _flag(
        None, "Use exactly this many KV cache blocks instead of sizing the cache from free memory.", type=int
    )
    gpu_memory_utilization: float = _flag(
        DEFAULT_GPU_MEMORY_UTILIZATION,
        "Fraction of GPU memory this engine may use (weights, activations, KV cache).",
        type=float,
    )
    swap_space: float = _flag(4, f"GiB of CPU swap per GPU. {_NO_EFFECT}: preemption recomputes.", type=float)
    cpu_offload_gb: float = _flag(
        0,
        "GiB of weights per GPU to keep in CPU memory, a virtual way to increase GPU memory: whole decoder "
        "layers, the first ones first, copied to the GPU right before each runs, so every step moves them "
        "over PCIe (slow). Ignored on the CPU, where every weight already is.",
        type=float,
    )
    quantization: str | None = _flag(
        None, "Weight quantization method (not supported yet).", type=nullable_str
    )
    kv_cache_dtype: str = _flag(
        "auto",
        "KV cache dtype. auto: the model dtype. fp8 (= fp8_e4m3, as in vLLM) or fp8_e5m2: one byte per "
        "element, twice the tokens of a 16-bit cache, at a small accuracy cost; per-layer k/v scales come "
        "from the checkpoint, else 1.0. On CUDA, float8 caches need compute capability 7.0; below 8.9 the "
        "kernels convert e4m3 from its bytes.",
        choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
    )
    tensor_parallel_size: int = _flag(
        1,
        "Tensor parallel ranks: GPUs (NCCL; alike GPUs, CUDA_VISIBLE_DEVICES picks them), or CPU processes "
        "(gloo). It must divide the attention heads and divide or be a multiple of the KV heads. Default: 1, "
        "or with several GPUs visible the smallest power of two that fits the model with a useful batch.",
        type=int,
        aliases=["-tp"],
    )
    pipeline_parallel_size: int = _flag(
        1,
        "Pipeline stages on one machine (Llama, Mistral, Qwen2, Qwen3; tp x pp GPUs).",
        type=int,
        aliases=["-pp"],
    )
    enforce_eager: bool = _flag(False, "Never capture CUDA graphs; run every step eagerly.", **_BOOL)
    trust_remote_code: bool = _flag(False, "Allow the model's own Python code from the hub.", **_BOOL)
    seed: int = _flag(0, "Random seed of the engine.", type=int)
    load_format: str = _flag(
        "auto",
        "Weight format: auto (safetensors or gguf by what the model has), safetensors, gguf, or dummy "
        "(random weights, for benchmarks).",
        choices=["auto", "safetensors", "gguf", "dummy"],
    )
    served_model_name: str | list[str] | None = _flag(
        None, "Name(s) the API answers to; the first is reported. Default: --model.", nargs="+"
    )
    generation_config: str = _flag(
        "auto",
        "Default sampling: auto (the model's generation_config.json), vllm (vLLM's defaults) or a folder "
        "holding a generation_config.json.",
    )
    max_logprobs: int = _flag(
        20,
        "Most log-probabilities a request may ask for per token (logprobs, top_logprobs, prompt_logprobs); "
        "-1: no limit (the vocabulary size).",
        type=int,
    )
    max_seq_len_to_capture: int = _flag(8192, f"{_NO_EFFECT}: use --compilation-config.", type=int)
    disable_custom_all_reduce: bool = _flag(
        False,
        "Tensor parallel on GPUs: send the decode step's small sums through NCCL instead of fitserve's "
        "one-shot all-reduce over peer memory.",
        **_BOOL,
    )
    compilation_config: str | dict | None = _flag(
        None,
        'JSON object; fitserve reads "cudagraph_capture_sizes": [1, 2, 4, ...] (batch sizes captured as '
        "CUDA graphs).",
        type=json_object,
    )
    cpu_kv_cache_space: float | None = _flag(
        None,
        "GiB of KV cache when running on the CPU. Default: 2 requests of max_model_len, within half the RAM "
        "available (docs/engine.md).",
        type=float,
    )
    disable_log_stats: bool = _flag(False, "Do not log throughput and cache statistics.", **_BOOL)
    device: str = _flag(
        "auto", "auto: cuda when torch sees a GPU, else cpu.", choices=["auto", "cuda", "cpu"]
    )
    enable_chunked_prefill: bool | None = _flag(
        None,
        "Chunked prefill is always on in fitserve (it does not change results); "
        "--no-enable-chunked-prefill is accepted and logged.",
        **_BOOL,
    )
    task: str = _flag(
        "auto",
        "vLLM's model task: auto or generate (fitserve serves text generation; other tasks are refused).",
    )
    enable_lora: bool = _flag(False, "Serve LoRA adapters (not supported yet).", **_BOOL)
    speculative_config: str | dict | None = _flag(
        None,
        "Speculative decoding, a JSON object with vLLM's keys, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}\' (docs/speculative.md).',
        type=json_object,
    )
    download_dir: str | None = _flag(None, "Hub download folder (not supported yet).", type=nullable_str)
    tokenizer_mode: str = _flag(
        "auto",
        "auto or hf: the fast tokenizer when there is one; slow: the Python tokenizer; mistral and custom "
        "are not supported yet.",
        choices=["auto", "hf", "slow", "mistral", "custom"],
    )
    tokenizer_revision: str | None = _flag(
        None, "Revision (branch, tag or commit) of a --tokenizer hub id.", type=nullable_str
    )
    hf_token: str | bool | None = _flag(
        None,
        "Hugging Face token for the hub's downloads (sets HF_TOKEN); with no value, the token of "
        "`hf auth login`.",
        type=_hf_token,
        nargs="?",
        const=True,
    )
    hf_overrides: str | dict | None = _flag(
        None, "JSON object set over the model's config.json (not supported yet).", type=json_object
    )
    override_generation_config: str | dict | None = _flag(
        None,
        'JSON object of generation_config.json keys set over the default sampling, e.g. \'{"temperature": '
        "0.5}' (with --generation-config vllm: the only defaults).",
        type=json_object,
    )
    code_revision: str | None = _flag(
        None, "Revision of the model's own code on the hub (not supported yet).", type=nullable_str
    )
    config_format: str = _flag(
        "auto",
        "Model config format: auto or hf (mistral is not supported yet).",
        choices=["auto", "hf", "mistral"],
    )
    data_parallel_size: int = _flag(
        1,
        "Engine replicas behind one `fitserve serve`, each on its own GPUs, requests to the least loaded "
        "(serve only).",
        type=int,
        aliases=["-dp"],
    )
    distributed_executor_backend: str | None = _flag(
        None,
        "Where the tensor/pipeline-parallel ranks run: mp (default: one process per rank on this host) or "
        "ray (Ray actors on the running Ray cluster, several machines too, or a local one; "
        'pip install "fitserve[ray]").',
        type=nullable_str,
    )
    scheduling_policy: str = _flag(
        "fcfs",
        "Order of waiting requests: fcfs (priority is not supported yet).",
        choices=["fcfs", "priority"],
    )
    preemption_mode: str | None = _flag(
        None,
        "vLLM's preemption mode; fitserve always preempts by recompute (swap is accepted and logged: the "
        "same tokens come out).",
        choices=["recompute", "swap", None],
        type=nullable_str,
    )
    kv_cache_memory_bytes: int | None = _flag(
        None, "KV cache bytes per GPU (not supported yet: use --num-gpu-blocks-override).", type=int
    )
    calculate_kv_scales: bool = _flag(
        False,
        "Compute fp8 KV scales from the data (not supported yet with an fp8 --kv-cache-dtype; the "
        "checkpoint's scales, else 1.0, are used). No effect with --kv-cache-dtype auto.",
        **_BOOL,
    )
    logits_processor_pattern: str | None = _flag(
        None, "Request-supplied logits processors (not supported yet).", type=nullable_str
    )
    async_scheduling: bool = _flag(
        False, f"{_NO_EFFECT}: the next step is always scheduled while the device runs this one.", **_BOOL
    )
    disable_sliding_window: bool = _flag(
        False,
        f"{_NO_EFFECT}: fitserve attends over the whole context and caps --max-model-len at the window.",
        **_BOOL,
    )
    max_num_partial_prefills: int = _flag(1, f"{_NO_EFFECT}: the token budget decides.", type=int)
    max_long_partial_prefills: int = _flag(1, f"{_NO_EFFECT}: the token budget decides.", type=int)
    num_scheduler_steps: int = _flag(1, f"{_NO_EFFECT} (vLLM V0's multi-step scheduling).", type=int)
    multi_step_stream_outputs: bool = _flag(True, f"{_NO_EFFECT} (vLLM V0's multi-step scheduling).", **_BOOL)
    max_parallel_loading_workers: int | None = _flag(None, f"{_NO_EFFECT}.", type=int)
    enable_sleep_mode: bool = _flag(False, f"{_NO_EFFECT}: fitserve has no sleep mode.", **_BOOL)
    disable_cascade_attn: bool = _flag(False, f"{_NO_EFFECT}: fitserve has no cascade attention.", **_BOOL)
    guided_decoding_backend: str | None = _flag(
        None,
        "vLLM's older name for --structured-outputs-config's backend: the structured-outputs engine, auto "
        "or xgrammar (fitserve runs xgrammar; guidance, outlines and lm-format-enforcer are refused).",
        type=nullable_str,
    )
    enable_expert_parallel: bool = _flag(
        False,
        "Split an MoE model's experts across the tensor-parallel ranks (each rank holds E / "
        "--tensor-parallel-size whole experts) instead of splitting every expert's width. "
        "No effect with one rank.",
        **_BOOL,
    )
    max_loras: int = _flag(1, f"{_NO_EFFECT}: LoRA adapters are not supported yet.", type=int)
    max_lora_rank: int = _flag(16, f"{_NO_EFFECT}: LoRA adapters are not supported yet.", type=int)
    max_cpu_loras: int | None = _flag(None, f"{_NO_EFFECT}: LoRA adapters are not supported yet.", type=int)
    model_impl: str = _flag(
        "auto",
        f"{_NO_EFFECT}: fitserve runs its own implementation of each architecture.",
        choices=["auto", "vllm", "transformers", "terratorch"],
    )
    otlp_traces_endpoint: str | None = _flag(
        None,
        f"{_NO_EFFECT}: fitserve exports no OpenTelemetry traces (it logs and serves /metrics).",
        type=nullable_str,
    )
    structured_outputs_config: str | dict | None = _flag(
        None,
        'Structured outputs, as JSON: {"backend": "auto" | "xgrammar"} (fitserve runs xgrammar; vLLM\'s '
        "guidance, outlines and lm-format-enforcer are refused). docs/structured_outputs.md.",
        type=json_object,
    )
    enable_prompt_embeds: bool = _flag(False, "Prompts as embeddings (not supported yet).", **_BOOL)
    skip_tokenizer_init: bool = _flag(
        False, "Serve token ids only, without a tokenizer (not supported yet).", **_BOOL
    )
    # Not flags. The fields the user set (None: those that differ from their default), and, for fields a
    # --config file set, "the 'key' key of --config FILE": a refusal then names the file's key.
    explicit_fields: frozenset[str] | None = field(default=None, compare=False, repr=False)
    config_keys: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_cli(cls, namespace: argparse.Namespace) -> EngineArgs:
        """The engine fields of a parsed namespace (other attributes, server or sampling, are left out),
        with the fields the user set: flags on the command line and keys of the --config file."""
        names = frozenset(f.name for f in _flag_fields())
        values = {name: getattr(namespace, name) for name in names if hasattr(namespace, name)}
        return cls(
            **values,
            explicit_fields=explicit_engine_fields(namespace, names),
            config_keys=config_key_sources(namespace, names),
        )

    def explicit(self) -> frozenset[str]:
        """The fields the user set. Without a record (EngineArgs built in Python with no `explicit_fields`),
        those whose value differs from the default."""
        if self.explicit_fields is not None:
            return frozenset(self.explicit_fields)
        return frozenset(f.name for f in _flag_fields() if getattr(self, f.name) != f.default)

    def check_ranges(self) -> None:
        for engine_field in _flag_fields():  # argparse checks choices for flags; this covers Python callers
            choices = engine_field.metadata["argparse"].get("choices")
            value = getattr(self, engine_field.name)
            if choices is not None and value not in choices:
                raise ValueError(
                    f"{engine_field.name}={value!r} is not one of {', '.join(map(str, choices))}: "
                    f"set --{_dashed(engine_field.name)} to one of them{_closest_choice(value, choices)}"
                )
        minimums: dict[str, tuple[float | None, float]] = {
            "max_model_len": (self.max_model_len, 1),
            "block_size": (self.block_size, 1),
            "max_num_seqs": (self.max_num_seqs, 1),
            "max_num_batched_tokens": (self.max_num_batched_tokens, 1),
            "long_prefill_token_threshold": (self.long_prefill_token_threshold, 0),
            "num_gpu_blocks_override": (self.num_gpu_blocks_override, 1),
            "swap_space": (self.swap_space, 0),
            "cpu_offload_gb": (self.cpu_offload_gb, 0),
            "tensor_parallel_size": (self.tensor_parallel_size, 1),
            "pipeline_parallel_size": (self.pipeline_parallel_size, 1),
            "max_seq_len_to_capture": (self.max_seq_len_to_capture, 1),
            "max_logprobs": (self.max_logprobs, -1),
            "data_parallel_size": (self.data_parallel_size, 1),
            "max_num_partial_prefills": (self.max_num_partial_prefills, 1),
            "max_long_partial_prefills": (self.max_long_partial_prefills, 1),
            "num_scheduler_steps": (self.num_scheduler_steps, 1),
            "max_parallel_loading_workers": (self.max_parallel_loading_workers, 1),
            "kv_cache_memory_bytes": (self.kv_cache_memory_bytes, 0),
        }
        for name, (value, minimum) in minimums.items():
            if value is not None and value < minimum:
                flag = f"--{_dashed(name)}"
                raise ValueError(
                    f"{name}={value} is below the minimum {minimum}: set {flag} to {minimum} or more"
                )
        if not math.isfinite(self.cpu_offload_gb):
            raise ValueError(
                f"cpu_offload_gb={self.cpu_offload_gb} is not a number of GiB: set --cpu-offload-gb to 0 "
                "or more"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} is outside (0, 1]: set "
                "--gpu-memory-utilization to a fraction such as 0.9"
            )
        check_cpu_kv_cache_space(self.cpu_kv_cache_space)
        check_structured_outputs_flags(self.structured_outputs_config, self.guided_decoding_backend)
        parse_capture_sizes(self.compilation_config)
        served_names(self.served_model_name)
        generation_overrides(self.override_generation_config)
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(self.generation_config):
            raise ValueError(
                f"generation_config={self.generation_config!r} is neither 'auto', 'vllm' nor a folder: "
                "give a folder holding generation_config.json, or auto / vllm"
            )
        budget = self.max_num_batched_tokens
        if budget is not None and budget < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={budget} is below max_num_seqs={self.max_num_seqs} (every running "
                f"request needs a token per step): raise --max-num-batched-tokens to {self.max_num_seqs} "
                "or lower --max-num-seqs"
            )

    def refuse_unsupported(self) -> None:
        """Features asked for that fitserve cannot do yet stop here, naming the fix (a field a --config file
        set is named by its key there); vLLM flags fitserve accepts without a mode of its own are logged
        once (fitserve/args_support.py)."""
        refuse_unsupported(self)


def engine_args_from_kwargs(model: str | None, kwargs: dict[str, Any]) -> EngineArgs:
    """EngineArgs from Python keywords (`LLM(model, max_model_len=...)`); the keywords given are the
    explicit fields. An unknown keyword is refused with the closest engine argument."""
    names = [f.name for f in _flag_fields()]
    for key in kwargs:
        if key not in names:
            raise ValueError(f"{key!r} is not an engine argument{_closest_choice(key, names)}")
    explicit = frozenset(kwargs) | ({"model"} if model is not None else frozenset())
    return EngineArgs(model=model, **kwargs, explicit_fields=explicit)


# generation_config.json keys fitserve reads (as does --override-generation-config) -> SamplingParams fields,
# as vLLM reads them
GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_overrides(value: str | dict | None) -> dict[str, Any]:
    """--override-generation-config as SamplingParams fields ({} when unset); ValueError naming a key
    fitserve does not read."""
    if value is None:
        return {}
    try:
        options = json_object(value)
    except (argparse.ArgumentTypeError, TypeError) as error:
        raise ValueError(f"--override-generation-config: {error}") from None
    unknown = sorted(set(options) - set(GENERATION_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"--override-generation-config key(s) {', '.join(unknown)} are not sampling defaults fitserve "
            f"reads: use {', '.join(GENERATION_CONFIG_KEYS)}"
        )
    return {GENERATION_CONFIG_KEYS[key]: item for key, item in options.items() if item is not None}


def served_names(names: str | Sequence[str] | None) -> tuple[str, ...]:
    if names is None:
        return ()
    result = (names,) if isinstance(names, str) else tuple(names)
    if not result or any(not name for name in result):
        raise ValueError(f"served_model_name={names!r} holds an empty name: give one or more non-empty names")
    return result


def _dashed(name: str) -> str:
    return name.replace("_", "-")


def _closest_choice(value: Any, choices: Sequence[Any]) -> str:
    close = difflib.get_close_matches(str(value), [str(choice) for choice in choices], n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every EngineArgs field as a vLLM-named flag, plus --config FILE.yaml."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--config",
        type=str,
        default=None,
        help="YAML file of flags (keys with dashes or underscores); flags on the command line win over it.",
    )
    for engine_field in _flag_fields():
        kwargs = dict(engine_field.metadata["argparse"])
        names = [f"--{_dashed(engine_field.name)}", *kwargs.pop("aliases", [])]
        group.add_argument(
            *names,
            dest=engine_field.name,
            default=engine_field.default,
            help=engine_field.metadata["help"],
            **kwargs,
        )
    record_explicit_flags(parser, frozenset(f.name for f in _flag_fields()))
    return parser


@functools.cache
def _flag_fields() -> tuple[Field, ...]:
    return tuple(f for f in fields(EngineArgs) if "argparse" in f.metadata)
