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
from pathlib import Path
from typing import Any

import torch
import yaml

from fitserve.arg_parser import json_object, nullable_str
from fitserve.capture_sizes import parse_capture_sizes
from fitserve.config import DEFAULT_GPU_MEMORY_UTILIZATION
from fitserve.cpu_kv_cache import check_cpu_kv_cache_space

DTYPES = {
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}
# Set on a parsed namespace by the engine flags' actions: the EngineArgs fields given on the command line.
EXPLICIT_FLAGS_DEST = "explicit_engine_flags"


def _flag(default: Any, help_text: str, **argparse_kwargs: Any) -> Any:
    return field(default=default, metadata={"help": help_text, "argparse": argparse_kwargs})


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
        "from the checkpoint, else 1.0. On CUDA, fp8_e4m3 needs compute capability 8.9.",
        choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
    )
    tensor_parallel_size: int = _flag(
        1, "Tensor parallel GPUs (only 1 supported yet).", type=int, aliases=["-tp"]
    )
    pipeline_parallel_size: int = _flag(
        1, "Pipeline stages (only 1 supported yet).", type=int, aliases=["-pp"]
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
    disable_custom_all_reduce: bool = _flag(False, f"{_NO_EFFECT} (single device).", **_BOOL)
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
        None, "Speculative decoding, JSON object (not supported yet).", type=json_object
    )
    download_dir: str | None = _flag(None, "Hub download folder (not supported yet).", type=nullable_str)
    # Not flags. The fields the user set (None: those that differ from their default), and, for fields a
    # --config file set, "the 'key' key of --config FILE": a refusal then names the file's key.
    explicit_fields: frozenset[str] | None = field(default=None, compare=False, repr=False)
    config_keys: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_cli(cls, namespace: argparse.Namespace) -> EngineArgs:
        """The engine fields of a parsed namespace (other attributes, server or sampling, are left out),
        with the fields the user set: flags on the command line and keys of the --config file."""
        values = {f.name: getattr(namespace, f.name) for f in _flag_fields() if hasattr(namespace, f.name)}
        return cls(
            **values,
            explicit_fields=explicit_engine_fields(namespace),
            config_keys=config_key_sources(namespace),
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
        parse_capture_sizes(self.compilation_config)
        served_names(self.served_model_name)
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
        """Features asked for that fitserve cannot do yet stop here; none is silently ignored. A field a
        --config file set is named by its key there, not by a flag the user never typed."""
        config_keys = self.config_keys
        refusals = [  # (field, asked, flag, fix, fix when a --config key set it)
            (
                "quantization",
                self.quantization is not None,
                f"--quantization {self.quantization}",
                "drop --quantization",
                "delete that key",
            ),
            (
                "tensor_parallel_size",
                self.tensor_parallel_size > 1,
                f"--tensor-parallel-size {self.tensor_parallel_size}",
                "set --tensor-parallel-size 1",
                "set it to 1",
            ),
            (
                "pipeline_parallel_size",
                self.pipeline_parallel_size > 1,
                f"--pipeline-parallel-size {self.pipeline_parallel_size}",
                "set --pipeline-parallel-size 1",
                "set it to 1",
            ),
            (
                "task",
                self.task not in ("auto", "generate"),
                f"--task {self.task}",
                "fitserve serves text generation: use --task generate or drop --task",
                "fitserve serves text generation: set it to generate or delete that key",
            ),
            (
                "enable_lora",
                self.enable_lora,
                "--enable-lora",
                "merge the adapter into the weights, or drop --enable-lora",
                "merge the adapter into the weights, or delete that key",
            ),
            (
                "speculative_config",
                self.speculative_config is not None,
                "--speculative-config",
                "drop --speculative-config",
                "delete that key",
            ),
            (
                "download_dir",
                self.download_dir is not None,
                f"--download-dir {self.download_dir}",
                "give --model a local folder",
                "delete that key and give --model a local folder",
            ),
        ]
        for name, asked, flag, fix, key_fix in refusals:
            if asked and config_keys and name in config_keys:
                raise ValueError(f"not supported yet: {flag}, set by {config_keys[name]} ({key_fix})")
            if asked:
                raise ValueError(f"not supported yet: {flag} ({fix})")
        if self.enable_chunked_prefill is False:
            logger.info(
                "--no-enable-chunked-prefill: chunked prefill stays on in fitserve (it does not change "
                "results)"
            )


def engine_args_from_kwargs(model: str | None, kwargs: dict[str, Any]) -> EngineArgs:
    """EngineArgs from Python keywords (`LLM(model, max_model_len=...)`); the keywords given are the
    explicit fields. An unknown keyword is refused with the closest engine argument."""
    names = [f.name for f in _flag_fields()]
    for key in kwargs:
        if key not in names:
            raise ValueError(f"{key!r} is not an engine argument{_closest_choice(key, names)}")
    explicit = frozenset(kwargs) | ({"model"} if model is not None else frozenset())
    return EngineArgs(model=model, **kwargs, explicit_fields=explicit)


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
    _record_explicit_flags(parser)
    return parser


@functools.cache
def _flag_fields() -> tuple[Field, ...]:
    return tuple(f for f in fields(EngineArgs) if "argparse" in f.metadata)


def _record_explicit_flags(parser: argparse.ArgumentParser) -> None:
    """Makes each engine flag record its field in the namespace when it appears on the command line."""
    parser.set_defaults(**{EXPLICIT_FLAGS_DEST: frozenset()})
    names = {f.name for f in _flag_fields()}
    for action in parser._actions:
        if action.option_strings and action.dest in names:
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
    the command line did not."""
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
    names = {f.name for f in _flag_fields()}
    keys = {str(key).replace("-", "_"): str(key) for key in content}
    return {name: key for name, key in keys.items() if name in names}
