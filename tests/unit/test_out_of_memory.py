"""The message for a step that ran out of GPU memory: the step's size, torch's numbers, that the server
goes on, and each knob with its current value and a value to try that the flag parser accepts."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from transformers import LlamaConfig

from fitserve.args import EngineArgs
from fitserve.cli.main import parse_command
from fitserve.config import (
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from fitserve.engine.out_of_memory import knob_suggestions, out_of_memory_message

TORCH_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
    "1.10 GiB is free. Including non-PyTorch memory, this process has 78.08 GiB memory in use. Of the "
    "allocated memory 75.20 GiB is allocated by PyTorch, and {reserved} is reserved by PyTorch but "
    "unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)


def oom(reserved: str = "12.00 MiB") -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(TORCH_OOM.format(reserved=reserved))


def config(
    device: str = "cuda",
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    gpu_memory_utilization: float = 0.9,
    enforce_eager: bool = False,
    num_gpu_blocks_override: int | None = None,
) -> EngineConfig:
    model = ModelConfig(
        model="m", model_path="/m", model_source="test", tokenizer="/m", hf_config=None,
        dtype=torch.bfloat16, max_model_len=4096,
    )  # fmt: skip
    return EngineConfig(
        model=model,
        cache=CacheConfig(
            gpu_memory_utilization=gpu_memory_utilization, num_gpu_blocks_override=num_gpu_blocks_override
        ),
        scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, 4096),
        device=DeviceConfig(device),
        compilation=CompilationConfig(enforce_eager=enforce_eager),
    )


def test_the_message_names_the_step_torch_numbers_and_every_knob() -> None:
    message = out_of_memory_message(config(), num_tokens=8192, num_seqs=37, error=oom())
    assert message.startswith(
        "Out of GPU memory in a step of 8,192 tokens over 37 sequences (torch tried to allocate 2.00 GiB "
        "with 1.10 GiB of GPU 0's 79.19 GiB free). The requests of that step were ended "
        '(finish_reason "error"); the server stays up, the other requests go on, and these can be retried.'
    )
    knobs = message.split("restart with one of: ", 1)[1].removesuffix(".")
    assert knobs.split("; ")[:4] == [
        "--max-num-batched-tokens 4096 (now 8192: a smaller step holds fewer activations)",
        "--max-num-seqs 128 (now 256: fewer sequences sample at once, so the sampler's logits are smaller)",
        "--gpu-memory-utilization 0.85 (now 0.9: the KV cache then takes 5% less of the GPU and leaves "
        "that room to the steps)",
        "--enforce-eager (CUDA graphs are on: eager mode frees their memory pool)",
    ]
    assert "expandable_segments" not in message  # 12 MiB reserved is not fragmentation
    assert message.endswith(")."), message


def test_eager_engines_are_not_told_to_turn_graphs_off() -> None:
    message = out_of_memory_message(config(enforce_eager=True), 512, 4, oom())
    assert "--enforce-eager" not in message
    assert "--gpu-memory-utilization 0.85 (now 0.9" in message


def test_fragmented_memory_names_the_allocator_setting() -> None:
    (fix,) = [f for f in knob_suggestions(config(), oom(reserved="3.50 GiB")) if "PYTORCH" in f]
    assert fix == (
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the environment (torch holds 3.50 GiB reserved "
        "but unallocated: the memory is fragmented)"
    )


def test_a_small_token_budget_lowers_max_num_seqs_with_it() -> None:
    fixes = knob_suggestions(config(max_num_batched_tokens=256, max_num_seqs=256))
    assert fixes[0] == (
        "--max-num-batched-tokens 128 with --max-num-seqs 128 or fewer (now 256: a smaller step holds "
        "fewer activations)"
    )


def test_a_fixed_block_count_is_lowered_instead_of_the_utilization() -> None:
    fixes = knob_suggestions(config(num_gpu_blocks_override=1000))
    assert "--num-gpu-blocks-override 900 (now 1000: a smaller KV cache leaves memory to the steps)" in fixes
    assert not any(f.startswith("--gpu-memory-utilization") for f in fixes)


def test_the_cpu_gets_its_own_kv_knob_and_any_error_is_described() -> None:
    cpu = config(device="cpu", max_num_batched_tokens=2048)
    cpu = dataclasses.replace(cpu, cache=dataclasses.replace(cpu.cache, cpu_kv_cache_space_gib=4.0))
    message = out_of_memory_message(cpu, 2048, 3, MemoryError())
    assert message.startswith("Out of memory in a step of 2,048 tokens over 3 sequences (MemoryError).")
    assert "--cpu-kv-cache-space 2 (now 4 GiB" in message
    assert "--gpu-memory-utilization" not in message and "--enforce-eager" not in message
    other = out_of_memory_message(config(), 10, 1, RuntimeError("cuBLAS failed. More text."))
    assert "(RuntimeError: cuBLAS failed)" in other
    one_seq = knob_suggestions(config(max_num_batched_tokens=1, max_num_seqs=1, enforce_eager=True))
    assert [fix.split(" ", 1)[0] for fix in one_seq] == ["--gpu-memory-utilization"]  # nothing to halve


def test_an_automatic_cpu_kv_cache_is_halved_from_the_size_its_rule_gives() -> None:
    hf_config = LlamaConfig(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64
    )
    cpu = config(device="cpu", max_num_batched_tokens=2048)
    model = dataclasses.replace(cpu.model, hf_config=hf_config, dtype=torch.float32, max_model_len=8192)
    cpu = dataclasses.replace(cpu, model=model)
    assert cpu.cache.cpu_kv_cache_space_gib is None
    # 2 requests of 8,192 tokens at 45 KiB a token, plus the null block: 0.70 GiB
    assert "--cpu-kv-cache-space 0.35 (now 0.7 GiB: a smaller KV cache leaves RAM to the steps)" in (
        knob_suggestions(cpu)
    )
    # the engine passes what it allocated (its memory plan's bytes, capped by the RAM): that is "now"
    capped = knob_suggestions(cpu, None, kv_cache_bytes=2**29)
    assert "--cpu-kv-cache-space 0.25 (now 0.5 GiB: a smaller KV cache leaves RAM to the steps)" in capped


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"max_num_batched_tokens": 256, "max_num_seqs": 256},
        {"gpu_memory_utilization": 0.5, "enforce_eager": True},
        {"num_gpu_blocks_override": 64},
    ],
)
def test_every_suggested_value_is_accepted_by_the_flag_parser(settings: dict) -> None:
    base = config(**settings)
    current = [
        "--max-num-batched-tokens", str(base.scheduler.max_num_batched_tokens),
        "--max-num-seqs", str(base.scheduler.max_num_seqs),
        "--gpu-memory-utilization", str(base.cache.gpu_memory_utilization),
    ]  # fmt: skip
    if base.cache.num_gpu_blocks_override is not None:
        current += ["--num-gpu-blocks-override", str(base.cache.num_gpu_blocks_override)]
    for fix in knob_suggestions(base, oom(reserved="4.00 GiB")):
        if not fix.startswith("--"):
            continue
        suggested = re.findall(r"(--[a-z-]+)(?: (\d[\d.]*))?", fix.split(" (", 1)[0])
        argv = [part for flag, value in suggested for part in (flag, value) if part]
        _, _, namespace = parse_command(["generate", "--prompt", "x", *current, *argv])
        EngineArgs.from_cli(namespace).check_ranges()  # raises on a value the engine refuses
