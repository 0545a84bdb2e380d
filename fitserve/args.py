"""Engine arguments with vLLM's flag names, and their command-line flags.

`EngineArgs` holds what the user asked for, unresolved; `create_engine_config()` resolves it once into
the frozen `EngineConfig`. Each field's flag (name, type, choices, help) is declared next to the field,
so the dataclass, the flags and the YAML keys (fitserve/arg_parser.py) cannot drift apart.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from fitserve.arg_parser import json_object, nullable_str
from fitserve.config import (
    FP8_KV_CACHE_DTYPES,
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from fitserve.cpu_kv_cache import check_cpu_kv_cache_space
from fitserve.logger import configure_default_logging

logger = logging.getLogger("fitserve")

# Token budget per step when --max-num-batched-tokens is not given. Chunked prefill is always on,
# so a prompt longer than the budget is split over steps: the budget bounds one step's work, not the
# prompt length. CPUs get a smaller step so that decodes of a running batch are not held up for long.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cuda": 8192, "cpu": 2048}
# `fitserve serve` on a GPU: short prefill chunks. A step that prefills 8,192 tokens of an 8B model takes
# ~195 ms on an H100, stalling every stream's next token and the first token of each request behind it;
# 1,024-token chunks keep such a step near 30 ms (docs/performance.md, "Serving: the prefill chunk").
SERVE_MAX_NUM_BATCHED_TOKENS = {"cuda": 1024, "cpu": 2048}


def default_max_num_batched_tokens(device: str, max_num_seqs: int, serving: bool) -> int:
    """The step's token budget when the user set none: at least max_num_seqs (one token each)."""
    table = SERVE_MAX_NUM_BATCHED_TOKENS if serving else DEFAULT_MAX_NUM_BATCHED_TOKENS
    return max(table[device], max_num_seqs)


DTYPES = {
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}
COMPILATION_CONFIG_KEYS = ("cudagraph_capture_sizes",)


def _flag(default: Any, help_text: str, **argparse_kwargs: Any) -> Any:
    return field(default=default, metadata={"help": help_text, "argparse": argparse_kwargs})


_BOOL = {"action": argparse.BooleanOptionalAction}
_NO_EFFECT = "Accepted for vLLM compatibility; has no effect in fitserve"


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
        0.9, "Fraction of GPU memory this engine may use (weights, activations, KV cache).", type=float
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
        None, "Chunked prefill is always on in fitserve; --no-enable-chunked-prefill is refused.", **_BOOL
    )
    enable_lora: bool = _flag(False, "Serve LoRA adapters (not supported yet).", **_BOOL)
    speculative_config: str | dict | None = _flag(
        None, "Speculative decoding, JSON object (not supported yet).", type=json_object
    )
    download_dir: str | None = _flag(None, "Hub download folder (not supported yet).", type=nullable_str)

    @classmethod
    def from_cli(cls, namespace: argparse.Namespace) -> EngineArgs:
        """The engine fields of a parsed namespace; other attributes (server, sampling) are left out."""
        return cls(**{f.name: getattr(namespace, f.name) for f in fields(cls) if hasattr(namespace, f.name)})

    def create_engine_config(self) -> EngineConfig:
        """Check every value, resolve the model, device and defaults; the one place that does so."""
        configure_default_logging()  # so the model's source and the resolved settings reach the log
        started = time.perf_counter()
        self.check_ranges()
        self._refuse_unsupported()
        device = _resolve_device(self.device)
        if device == "cuda" and self.block_size < MIN_CUDA_BLOCK_SIZE:
            raise ValueError(
                f"block_size={self.block_size} is below {MIN_CUDA_BLOCK_SIZE}, the smallest block the CUDA "
                f"attention kernels take: set --block-size {MIN_CUDA_BLOCK_SIZE} (or 32, 64, 128)"
            )
        if device == "cuda":
            check_fp8_kv_cache_on_gpu(self.kv_cache_dtype, torch.cuda.get_device_capability())
        compilation = CompilationConfig(
            enforce_eager=self.enforce_eager, cudagraph_capture_sizes=_capture_sizes(self.compilation_config)
        )
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(self.generation_config):
            raise ValueError(
                f"generation_config={self.generation_config!r} is neither 'auto', 'vllm' nor a folder: "
                "give a folder holding generation_config.json, or auto / vllm"
            )
        # Imported here: parsing flags needs no model code.
        from fitserve.models.default_model import DEFAULT_MODEL_ID
        from fitserve.models.loader import load_hf_config, model_max_length, resolve_model

        # The requested dtype only matters for a .gguf model: what its weights are dequantized to.
        resolved = resolve_model(self.model, self.revision)
        hf_config = load_hf_config(resolved.model_path, trust_remote_code=self.trust_remote_code)
        _refuse_quantized_checkpoint(hf_config, resolved.model_path)
        max_model_len = self._resolve_max_model_len(model_max_length(hf_config), resolved.model_path)
        model = ModelConfig(
            model=DEFAULT_MODEL_ID if self.model is None else self.model,
            model_path=resolved.model_path,
            model_source=resolved.source,
            tokenizer=self.tokenizer or resolved.tokenizer_path,
            hf_config=hf_config,
            dtype=resolve_dtype(self.dtype, hf_config, device),
            max_model_len=max_model_len,
            load_format=self.load_format,
            seed=self.seed,
            trust_remote_code=self.trust_remote_code,
            generation_config=self.generation_config,
            served_model_name=_served_names(self.served_model_name),
            revision=self.revision,
            cpu_offload_gb=_resolve_cpu_offload_gb(self.cpu_offload_gb, device),
            card_sampling=resolved.card_sampling,
            card_sampling_source=resolved.card_sampling_source,
        )
        cache = CacheConfig(
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            gpu_memory_utilization=self.gpu_memory_utilization,
            swap_space=float(self.swap_space),
            kv_cache_dtype=self.kv_cache_dtype,
            cpu_kv_cache_space_gib=(
                None if self.cpu_kv_cache_space is None else float(self.cpu_kv_cache_space)
            ),
        )
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self._resolve_max_num_batched_tokens(device),
            max_model_len=max_model_len,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
        )
        config = EngineConfig(
            model=model,
            cache=cache,
            scheduler=scheduler,
            parallel=ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size),
            device=DeviceConfig(device),
            compilation=compilation,
            quantization=self.quantization,
            disable_log_stats=self.disable_log_stats,
        )
        logger.info("Resolved the model and the engine settings in %.1f s", time.perf_counter() - started)
        return config

    def check_ranges(self) -> None:
        for engine_field in fields(self):  # argparse checks choices for flags; this covers Python callers
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
        budget = self.max_num_batched_tokens
        if budget is not None and budget < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={budget} is below max_num_seqs={self.max_num_seqs} (every running "
                f"request needs a token per step): raise --max-num-batched-tokens to {self.max_num_seqs} "
                "or lower --max-num-seqs"
            )

    def _refuse_unsupported(self, config_keys: dict[str, str] | None = None) -> None:
        """Features asked for that fitserve cannot do yet stop here; none is silently ignored.

        `config_keys`: field -> where a --config file set it ("the 'quantization' key of --config
        x.yaml"), so the fix names the file's key rather than a flag the user never typed."""
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
                "enable_chunked_prefill",
                self.enable_chunked_prefill is False,
                "--no-enable-chunked-prefill",
                "drop it: chunked prefill is always on",
                "delete that key: chunked prefill is always on",
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

    def _resolve_max_model_len(self, model_limit: int, model_path: str) -> int:
        if self.max_model_len is None:
            return model_limit
        if self.max_model_len > model_limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} is above the model's own limit {model_limit} "
                f"({model_path}): set --max-model-len {model_limit} or less"
            )
        return self.max_model_len

    def _resolve_max_num_batched_tokens(self, device: str) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return default_max_num_batched_tokens(device, self.max_num_seqs, serving=False)


# The Triton paged-attention kernels tile a block's tokens: a power of two of at least 16.
MIN_CUDA_BLOCK_SIZE = 16
# Triton converts to float8 e4m3 (fp8e4nv) from this compute capability on; e5m2 works on older GPUs.
FP8_E4M3_MIN_CAPABILITY = (8, 9)


def resolve_dtype(requested: str, hf_config: Any, device: str) -> torch.dtype:
    """The dtype to run in; `requested` is "auto" or a key of DTYPES (see the --dtype help for "auto")."""
    if requested != "auto":
        dtype = DTYPES[requested]
        if device == "cuda" and dtype == torch.bfloat16 and not _cuda_has_bf16():
            raise ValueError(
                f"dtype=bfloat16 needs compute capability 8.0, this GPU has "
                f"{'.'.join(map(str, torch.cuda.get_device_capability()))}: set --dtype half"
            )
        return dtype
    if device == "cpu":
        return torch.float32
    model_dtype = _model_dtype(hf_config)
    if model_dtype not in (torch.float16, torch.bfloat16):
        model_dtype = torch.bfloat16
    if model_dtype == torch.bfloat16 and not _cuda_has_bf16():
        return torch.float16
    return model_dtype


def _model_dtype(hf_config: Any) -> torch.dtype | None:
    # transformers >= 4.56 names it `dtype`; older configs only have `torch_dtype`.
    value = hf_config.dtype if hasattr(hf_config, "dtype") else getattr(hf_config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None


def _refuse_quantized_checkpoint(hf_config: Any, model_path: str) -> None:
    quantization_config = getattr(hf_config, "quantization_config", None)
    if quantization_config is None:
        return
    method = (
        quantization_config.get("quant_method")
        if isinstance(quantization_config, dict)
        else getattr(quantization_config, "quant_method", None)
    )
    raise ValueError(
        f"not supported yet: a quantized checkpoint (quant_method {method} in {model_path}) "
        "(pick the model's unquantized release)"
    )


def check_fp8_kv_cache_on_gpu(kv_cache_dtype: str, capability: tuple[int, int]) -> None:
    """The Triton kernels convert to float8 e4m3 only from compute capability 8.9 (Ada, Hopper) on."""
    is_e4m3 = FP8_KV_CACHE_DTYPES.get(kv_cache_dtype) == torch.float8_e4m3fn
    if is_e4m3 and capability < FP8_E4M3_MIN_CAPABILITY:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype} (float8 e4m3) needs compute capability "
            f"{'.'.join(map(str, FP8_E4M3_MIN_CAPABILITY))}, this GPU has {'.'.join(map(str, capability))}: "
            "set --kv-cache-dtype fp8_e5m2 (also one byte per element) or auto"
        )


def _resolve_cpu_offload_gb(cpu_offload_gb: float, device: str) -> float:
    """GiB of decoder layers the loader keeps in CPU memory: as asked on CUDA; on the CPU nothing to move."""
    if device == "cpu" and cpu_offload_gb > 0:
        logger.warning(
            "cpu_offload_gb=%g is ignored on the CPU device: every weight is already in CPU memory "
            "(drop --cpu-offload-gb to silence this)",
            cpu_offload_gb,
        )
        return 0.0
    return float(cpu_offload_gb)


def _cuda_has_bf16() -> bool:
    return torch.cuda.get_device_capability() >= (8, 0)


def _resolve_device(requested: str) -> str:
    has_cuda = torch.cuda.is_available()
    if requested == "auto":
        return "cuda" if has_cuda else "cpu"
    if requested == "cuda" and not has_cuda:
        raise ValueError("device=cuda but torch sees no CUDA GPU: set --device cpu or --device auto")
    return requested


def _capture_sizes(compilation_config: str | dict | None) -> tuple[int, ...]:
    """Batch sizes to capture as CUDA graphs, ascending and unique; () = the runner's default."""
    if compilation_config is None:
        return ()
    options = json_object(compilation_config)
    unknown = sorted(set(options) - set(COMPILATION_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"not supported yet: --compilation-config key(s) {', '.join(unknown)} (fitserve reads only "
            f"{', '.join(COMPILATION_CONFIG_KEYS)}: drop the others)"
        )
    sizes = options.get("cudagraph_capture_sizes", [])
    if not isinstance(sizes, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
        raise ValueError(
            f"cudagraph_capture_sizes={sizes!r} is not a list of integers: write e.g. [1, 2, 4, 8]"
        )
    if min(sizes, default=1) < 1:
        raise ValueError(
            f"cudagraph_capture_sizes={sizes} holds {min(sizes)}, below the minimum 1: use sizes of 1 or more"
        )
    return tuple(sorted(set(sizes)))


def _served_names(names: str | Sequence[str] | None) -> tuple[str, ...]:
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
    for engine_field in fields(EngineArgs):
        kwargs = dict(engine_field.metadata["argparse"])
        names = [f"--{_dashed(engine_field.name)}", *kwargs.pop("aliases", [])]
        group.add_argument(
            *names,
            dest=engine_field.name,
            default=engine_field.default,
            help=engine_field.metadata["help"],
            **kwargs,
        )
    return parser
