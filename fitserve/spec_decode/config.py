"""`--speculative-config` as vLLM reads it: a JSON object (flag), a mapping (config.yaml,
`LLM(speculative_config=...)`), checked once into a frozen `SpeculativeConfig`.

Keys: `method`, `num_speculative_tokens`, `prompt_lookup_min` / `prompt_lookup_max` (ngram), `model`,
`draft_tensor_parallel_size`, `revision`, `quantization`, `max_model_len` (draft_model),
`disable_by_batch_size`. Methods fitserve runs: `ngram` (prompt lookup), `draft_model` (a smaller model of
the same vocabulary, fitserve/spec_decode/draft_model.py; also `model` given without `method`), `eagle3`
(an EAGLE-3 draft head in its released checkpoint format reading the target's hidden states,
fitserve/spec_decode/eagle3/), `mtp` (the checkpoint's own multi-token-prediction layer, Qwen3.5 /
Qwen3.6: fitserve/spec_decode/mtp.py; vLLM's `qwen3_next_mtp` and `deepseek_mtp` are read as `mtp`) and, for
benchmarks only, `oracle` (drafts the tokens a first pass produced, fitserve/spec_decode/oracle.py).
`eagle` (EAGLE-1) and `suffix` are vLLM's other methods: refused with what runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fitserve.kv_groups import KvCacheGroup

# What each method needs, and the most draft tokens one step verifies (a verify step computes
# batch x (k + 1) tokens; past 15 a miss wastes more than any acceptance saves).
MAX_SPECULATIVE_TOKENS = 15
RUNS = ("ngram", "draft_model", "eagle3", "mtp", "oracle")
# vLLM's other names for the checkpoint's MTP layers, read as mtp
MTP_ALIASES = ("qwen3_next_mtp", "deepseek_mtp")
# mtp reuses its one layer for every draft: past this many the drafts it chains are rarely accepted
MAX_MTP_SPECULATIVE_TOKENS = 8
# methods that load a second checkpoint named by "model"
WITH_MODEL = ("draft_model", "eagle3")
NOT_BUILT = {
    "eagle": "EAGLE-1 draft heads (fitserve runs EAGLE-3 heads: method eagle3)",
    "medusa": "Medusa heads",
    "mlp_speculator": "an MLP speculator",
    "suffix": "suffix decoding",
}
KEYS = {
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
    "draft_tensor_parallel_size",
    "disable_by_batch_size",
    "quantization",
    "revision",
    "max_model_len",
}
# vLLM's ngram defaults when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    # No drafts for a step with more running requests than this (vLLM's key); None: fitserve's own
    # rule (fitserve/spec_decode/speculator.py) decides from the batch and the acceptance.
    disable_by_batch_size: int | None = None
    # draft_model: the draft's folder or hub id, its revision and --quantization, its own context limit
    # (None: its config's), and vLLM's draft_tensor_parallel_size (1: the draft runs whole on the first
    # GPU, beside a tensor-parallel target too)
    model: str | None = None
    revision: str | None = None
    quantization: str | None = None
    max_model_len: int | None = None
    draft_tensor_parallel_size: int | None = None

    def describe(self) -> str:
        if self.method == "ngram":
            return (
                f"ngram, {self.num_speculative_tokens} draft tokens, prompt lookup "
                f"{self.prompt_lookup_min}..{self.prompt_lookup_max} tokens"
            )
        if self.method == "draft_model":
            return f"draft_model {self.model}, {self.num_speculative_tokens} draft tokens (greedy drafts)"
        if self.method == "eagle3":
            return f"eagle3 head {self.model}, {self.num_speculative_tokens} draft tokens (greedy drafts)"
        if self.method == "mtp":
            return f"mtp (the checkpoint's MTP layer), {self.num_speculative_tokens} draft tokens (greedy)"
        return f"{self.method}, {self.num_speculative_tokens} draft tokens"


def _positive_int(raw: dict[str, Any], key: str, default: int | None = None) -> int | None:
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"--speculative-config {key} is {value!r}: it must be a whole number of at least 1 "
            f'(e.g. "{key}": 3)'
        )
    return value


def parse_speculative_config(raw: dict[str, Any] | None) -> SpeculativeConfig | None:
    """The checked config, or None when speculative decoding is off (no config, or `{}`)."""
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise ValueError(
            f"--speculative-config is {raw!r}: give a JSON object, e.g. "
            '\'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}\''
        )
    unknown = sorted(set(raw) - KEYS)
    if unknown:
        raise ValueError(
            f"--speculative-config has unknown key(s) {', '.join(unknown)}: the keys are "
            f"{', '.join(sorted(KEYS))}"
        )
    method = raw.get("method")
    if method is None:
        method = "draft_model" if raw.get("model") else None
    if method in ("[ngram]",):
        method = "ngram"
    if method in MTP_ALIASES:
        method = "mtp"
    if method is None:
        raise ValueError(
            '--speculative-config has no method: set "method" to ngram (prompt lookup) or draft_model '
            '(with "model"), e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\''
        )
    if method in NOT_BUILT:
        raise ValueError(
            f"--speculative-config method {method!r} (speculation with {NOT_BUILT[method]}) is not built in "
            f"fitserve yet: use method ngram (prompt lookup, no second model), draft_model (a smaller "
            f"model of the same vocabulary), eagle3 (an EAGLE-3 head) or mtp (the checkpoint's MTP "
            f"layer), or drop --speculative-config"
        )
    if method not in RUNS:
        raise ValueError(
            f"--speculative-config method {method!r} is unknown: fitserve runs {', '.join(RUNS[:4])} "
            f"(vLLM's other methods: {', '.join(NOT_BUILT)})"
        )
    k = _positive_int(raw, "num_speculative_tokens")
    if k is None:
        raise ValueError(
            f"--speculative-config method {method} needs num_speculative_tokens (draft tokens a step "
            'verifies, e.g. "num_speculative_tokens": 3)'
        )
    if k > MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"--speculative-config num_speculative_tokens is {k}, above the limit of "
            f"{MAX_SPECULATIVE_TOKENS}: a verify step computes k + 1 tokens per request, so set 1 to "
            f"{MAX_SPECULATIVE_TOKENS} (3 to 5 is usual)"
        )
    if method == "mtp" and k > MAX_MTP_SPECULATIVE_TOKENS:
        raise ValueError(
            f"--speculative-config num_speculative_tokens is {k}, above method mtp's limit of "
            f"{MAX_MTP_SPECULATIVE_TOKENS}: the one MTP layer drafts every token from its own last output, "
            f"so set 1 to {MAX_MTP_SPECULATIVE_TOKENS} (2 to 4 is usual)"
        )
    lookup_min = _positive_int(raw, "prompt_lookup_min")
    lookup_max = _positive_int(raw, "prompt_lookup_max")
    if lookup_min is None and lookup_max is None:
        lookup_min = lookup_max = DEFAULT_PROMPT_LOOKUP
    lookup_min = lookup_min or lookup_max
    lookup_max = lookup_max or lookup_min
    if lookup_min > lookup_max:
        raise ValueError(
            f"--speculative-config prompt_lookup_min {lookup_min} is above prompt_lookup_max {lookup_max}: "
            "the lookup tries the longest match first, from prompt_lookup_max down to prompt_lookup_min"
        )
    draft = _draft_keys(raw, method)
    return SpeculativeConfig(
        method=method,
        num_speculative_tokens=k,
        prompt_lookup_min=lookup_min,
        prompt_lookup_max=lookup_max,
        disable_by_batch_size=_positive_int(raw, "disable_by_batch_size"),
        **draft,
    )


def _draft_keys(raw: dict[str, Any], method: str) -> dict[str, Any]:
    """draft_model's and eagle3's keys, checked: a model is required, draft_tensor_parallel_size is 1 (or
    the target's size, checked by the engine against it: the draft runs on one device either way)."""
    if method not in WITH_MODEL:
        return {}
    model = raw.get("model")
    if method == "eagle3" and (not isinstance(model, str) or not model.strip()):
        raise ValueError(
            f'--speculative-config method eagle3 needs "model" (is {model!r}): the EAGLE-3 head\'s folder or '
            'hub id, trained for this target, e.g. \'{"method": "eagle3", "model": '
            '"yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3}\''
        )
    if not isinstance(model, str) or not model.strip():
        raise ValueError(
            f'--speculative-config method draft_model needs "model" (is {model!r}): the draft model\'s '
            'folder or hub id, a smaller model of the same vocabulary, e.g. \'{"method": "draft_model", '
            '"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "num_speculative_tokens": 3}\''
        )
    return {
        "model": model,
        "revision": raw.get("revision"),
        "quantization": raw.get("quantization"),
        "max_model_len": _positive_int(raw, "max_model_len"),
        "draft_tensor_parallel_size": _positive_int(raw, "draft_tensor_parallel_size"),
    }


# The methods whose drafter keeps its own keys and values in the target's block table (group 0's)
DRAFT_KV_METHODS = ("draft_model", "eagle3", "mtp")


def check_speculative_model(config: SpeculativeConfig, kv_groups: Sequence[KvCacheGroup]) -> None:
    """Refuses, before any weight loads, what a verify step cannot serve yet: a drafter with a KV cache of
    its own (it lives in the first KV cache group's blocks, as many as that group's pool) where that group
    is a sliding window's among several (its blocks behind the window are freed, and the drafter's keys
    there with them). The full-attention group comes first wherever a model has one (kv_groups.py), so
    Gemma-4 past its window takes every method; n-gram drafting has no cache and runs everywhere
    (tests/unit/test_spec_decode_sliding.py); hybrid models speculate with every method (their verify
    steps keep the state after each token: worker/state_rings.py)."""
    if len(kv_groups) > 1 and kv_groups[0].is_sliding and config.method in DRAFT_KV_METHODS:
        raise ValueError(
            f"--speculative-config method {config.method} keeps the drafter's KV cache in the first KV cache "
            f"group's blocks, here a sliding window of {kv_groups[0].sliding_window} tokens among "
            f"{len(kv_groups)} groups, which frees them behind the window: not built yet. Use "
            '\'{"method": "ngram", "num_speculative_tokens": 3}\' (no cache of its own), or set '
            "--max-model-len to the window or less (its layers then keep one group)"
        )
