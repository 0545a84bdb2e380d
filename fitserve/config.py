"""Frozen, resolved engine configuration.

`EngineArgs` (fitserve/args.py) holds what the user asked for, with vLLM's names;
`fitserve.planner.create_engine_config(args)` resolves it once into an `EngineConfig`, which records
which values the user set and each value the planner chose, with its reason. Nothing writes to a config
after that: a component that needs a different value builds a new one with `dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from fitserve.kv_groups import KvCacheGroup, elements_per_request_token, kv_cache_groups
from fitserve.kv_layers import KvLayerSpec, kv_layer_specs
from fitserve.spec_decode.config import SpeculativeConfig

# --kv-cache-dtype values other than "auto" (the model dtype) -> the cache's torch dtype. As in vLLM,
# "fp8" is e4m3. One byte per element: twice the tokens of a 16-bit cache in the same memory.
FP8_KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# The fraction of GPU memory an engine takes when --gpu-memory-utilization is unset (vLLM's default).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class Choice:
    """One resolved setting as the startup log and `fitserve plan` print it."""

    setting: str  # an EngineArgs field, or cudagraph_capture_sizes
    value: Any
    reason: str
    explicit: bool = False  # the user set it

    def origin(self) -> str:
        """How the log line names where the value came from: the user (and why it matters, when the
        plan says), or auto-fit with why this value."""
        if not self.explicit:
            return f"auto-fit: {self.reason}"
        if self.reason.startswith("set by you"):
            return self.reason
        return f"set by you: {self.reason}"

    def log_line(self) -> str:
        return f"{self.setting} = {self.value} ({self.origin()})"


@dataclass(frozen=True)
class ModelConfig:
    model: str  # what the user named: a folder, a hub id, a .gguf file, or the default model
    model_path: str  # a local folder with config.json (+ weights unless load_format == "dummy")
    model_source: str  # one line for the log: where the weights came from
    tokenizer: str  # a local folder or hub id the tokenizer loads from
    hf_config: Any  # transformers.PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    seed: int = 0
    trust_remote_code: bool = False
    generation_config: str = "auto"  # auto | vllm | a folder holding generation_config.json
    served_model_name: tuple[str, ...] = ()
    revision: str | None = None
    # GiB of decoder-layer weights kept in CPU memory (--cpu-offload-gb); 0 on the CPU device
    cpu_offload_gb: float = 0.0
    # --quantization: reaches model construction on hf_config (models/loader.py, layers/quantization)
    quantization: str | None = None
    # --enable-expert-parallel: an MoE model's experts split across the tensor-parallel ranks (Gemma-4)
    enable_expert_parallel: bool = False
    # Sampling defaults the model's publisher states outside generation_config.json (the default model's
    # card), and where; with generation_config "auto" they sit under the file's own values.
    card_sampling: dict[str, Any] = field(default_factory=dict)
    card_sampling_source: str = ""
    # --max-logprobs: most logprobs / prompt_logprobs a request may ask for per token; -1: no limit
    max_logprobs: int = 20
    tokenizer_mode: str = "auto"  # auto | hf (the fast tokenizer) | slow
    tokenizer_revision: str | None = None
    # --override-generation-config, in SamplingParams names: set over the generation_config defaults
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    # --mamba-cache-mode, resolved (none without prefix caching): how a hybrid model's recurrent state pool
    # keeps snapshots for prefix caching; read by its worker and scheduler sides (core/state_slots.py)
    mamba_cache_mode: str = "align"

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or []
        return archs[0] if archs else ""

    @property
    def name_for_api(self) -> str:
        return self.served_model_name[0] if self.served_model_name else self.model

    @property
    def head_dim(self) -> int:
        cfg = self.hf_config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        cfg = self.hf_config
        return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def kv_layers(self) -> tuple[KvLayerSpec, ...]:
        """Each decoder layer's KV cache geometry (differs by layer on Gemma-4)."""
        return kv_layer_specs(self.hf_config)

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    swap_space: float = 4.0  # GiB, accepted for vLLM compatibility (preemption is by recompute)
    kv_cache_dtype: str = "auto"  # auto | a key of FP8_KV_CACHE_DTYPES
    # --cpu-kv-cache-space; None: sized to max_model_len within the RAM available (fitserve/cpu_kv_cache.py)
    cpu_kv_cache_space_gib: float | None = None

    def torch_kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's element type: the model dtype for "auto", else the float8 type asked for."""
        if self.kv_cache_dtype == "auto":
            return model_dtype
        return FP8_KV_CACHE_DTYPES[self.kv_cache_dtype]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    long_prefill_token_threshold: int = 0  # most tokens one request computes in a step; 0: no limit


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # where ranks 1.. run: "mp" (processes of this host) or "ray" (Ray actors, worker/ray_ranks.py)
    distributed_executor_backend: str = "mp"
    # small GPU sums through NCCL instead of distributed/custom_all_reduce.py
    disable_custom_all_reduce: bool = False


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"  # "cpu" or "cuda"

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


@dataclass(frozen=True)
class CompilationConfig:
    enforce_eager: bool = False
    cudagraph_capture_sizes: tuple[int, ...] = ()


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    quantization: str | None = None
    disable_log_stats: bool = False
    speculative: SpeculativeConfig | None = None  # --speculative-config; None: off
    # The EngineArgs fields the user set, and every setting as resolved, with its reason (the log's lines).
    explicit: frozenset[str] = frozenset()
    choices: tuple[Choice, ...] = ()

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token of a max_model_len request over the layers that own a cache (each with
        its own geometry, fitserve/kv_layers.py; a sliding group counts only the blocks its window keeps,
        fitserve/kv_groups.py): K and V, in the cache's element type."""
        model = self.model
        element = self.cache.torch_kv_cache_dtype(model.dtype).itemsize
        elements = elements_per_request_token(self.kv_groups, model.max_model_len, self.cache.block_size)
        return elements * element

    @property
    def kv_groups(self) -> tuple[KvCacheGroup, ...]:
        """The layers grouped by the blocks they keep (fitserve/kv_groups.py): one group unless some layers
        have a sliding window shorter than max_model_len needs."""
        return kv_cache_groups(
            self.model.kv_layers,
            self.model.max_model_len,
            self.scheduler.max_num_batched_tokens,
            self.cache.block_size,
            self.parallel.tensor_parallel_size,
        )

    @property
    def rank_kv_layers(self) -> tuple[KvLayerSpec, ...]:
        """Each layer's KV cache geometry on one tensor-parallel rank: its share of the KV heads (one at
        least: with fewer heads than ranks each is replicated, layers/tp_shards.py)."""
        size = self.parallel.tensor_parallel_size
        return tuple(
            dataclasses.replace(spec, num_kv_heads=max(1, spec.num_kv_heads // size))
            for spec in self.model.kv_layers
        )
