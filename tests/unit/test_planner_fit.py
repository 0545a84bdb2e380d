"""Auto-fit: each choice and its reason, explicit settings winning, and every refusal's numbers and fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fitserve.args import EngineArgs
from fitserve.planner.engine_support import NOT_RUN_BY_FITSERVE
from fitserve.planner.fit import FitResult, PlanError, auto_fit
from fitserve.planner.hardware import DeviceSpec, GiB, parse_assume_gpus
from fitserve.planner.resolve import create_engine_config
from tests.unit.planner_helpers import H100, model_info

SEQS = frozenset({"max_num_seqs"})  # max_num_seqs set explicitly (its default value)


def fit(
    name: str, gpus: str = H100, explicit: frozenset[str] = frozenset(), serving: bool = False, **args: object
) -> FitResult:
    """The plan for offline generation (the 8,192-token step on a GPU), or for `fitserve serve`."""
    engine_args = EngineArgs(**args)  # type: ignore[arg-type]
    return auto_fit(model_info(name), engine_args, parse_assume_gpus(gpus), explicit, serving=serving)


def choice(result: FitResult, setting: str) -> tuple[object, str]:
    (found,) = [c for c in result.choices if c.setting == setting]
    return found.value, found.reason


def busy_gpu(total_gib: float, free_gib: float, capability: tuple[int, int] = (9, 0)) -> DeviceSpec:
    return DeviceSpec("cuda", 0, "NVIDIA H100", int(total_gib * GiB), int(free_gib * GiB), capability)


def test_dtype_bf16_from_sm_8_and_fp16_below() -> None:
    assert choice(fit("llama-3.1-8b"), "dtype") == (
        "bfloat16",
        "the model's bfloat16; SM 9.0 runs it natively",
    )
    value, reason = choice(fit("deepseek-r1-distill-qwen-7b", "1x31.75@7.0"), "dtype")
    assert value == "float16"
    assert reason == "fp16: the GPU's compute capability 7.0 is below 8.0 (no fast bf16)"
    value, reason = choice(fit("llama-3.1-8b", "1x80"), "dtype")
    assert value == "bfloat16" and "capability unknown, taken as 8.0+" in reason


def test_explicit_bf16_on_an_old_gpu_is_refused() -> None:
    with pytest.raises(
        PlanError, match=r"dtype=bfloat16 needs compute capability 8.0, .* has 7.5: set --dtype half"
    ):
        fit("qwen3-0.6b", "1x16@7.5", dtype="bfloat16")


def test_model_max_len_kept_when_two_full_requests_fit() -> None:
    result = fit("llama-3.1-8b")
    assert result.plan.inputs.max_model_len == 131072
    value, reason = choice(result, "max_model_len")
    tokens = result.plan.kv_cache_tokens
    assert reason == f"the model's own; the KV cache ({tokens:,} tokens) holds {tokens / 131072:.1f}x"
    assert result.plan.inputs.max_model_len == 131072


def test_max_model_len_lowered_to_what_two_requests_fit() -> None:
    result = fit("deepseek-r1-distill-qwen-7b", "1x31.75@7.0")
    plan = result.plan
    length = plan.inputs.max_model_len
    assert length % 16 == 0 and length < 131072
    assert 2 * length <= plan.kv_cache_tokens < 2 * (length + 16) + 16
    _, reason = choice(result, "max_model_len")
    assert re.match(
        r"the model's own 131,072 fits 1\.\d\dx in the KV cache \([\d,]+ tokens\): lowered", reason
    )


def test_explicit_max_model_len_too_long_names_the_largest_that_fits() -> None:
    with pytest.raises(PlanError) as error:
        fit("llama-3.1-8b", "1x24@8.9", max_model_len=65536)
    assert error.value.kind == "kv_cache"
    message = str(error.value)
    largest = int(re.search(r"--max-model-len (\d+) \(the largest that fits\)", message)[1])  # type: ignore[index]
    assert "the KV cache cannot hold one max_model_len=65,536 request" in message
    assert f"holds {largest:,} tokens" in message
    fp8_tokens = int(
        re.search(r"--kv-cache-dtype fp8 \(one byte per KV element\): ([\d,]+) KV", message)[1].replace(
            ",", ""
        )
    )  # type: ignore[index]
    assert fp8_tokens >= 2 * largest
    # the numbers are the planner's own: the length it names fits, one block more does not
    assert fit("llama-3.1-8b", "1x24@8.9", max_model_len=largest).plan.inputs.max_model_len == largest
    with pytest.raises(PlanError):
        fit("llama-3.1-8b", "1x24@8.9", max_model_len=largest + 16)


def test_max_model_len_above_the_model_limit() -> None:
    with pytest.raises(
        PlanError, match=r"max_model_len=50000 is above the model's own limit 40960: set --max"
    ):
        fit("qwen3-8b", max_model_len=50000)


def test_utilization_lowered_when_another_process_holds_the_gpu() -> None:
    info = model_info("llama-3.1-8b")
    result = auto_fit(info, EngineArgs(max_model_len=4096), [busy_gpu(79.19, 50.0)])
    value, reason = choice(result, "gpu_memory_utilization")
    assert value == 0.63  # floor(50 / 79.19, 2 decimals)
    assert reason.startswith("other processes hold 29.19 GiB of GPU 0 (NVIDIA H100")
    assert "0.9 would need 71.27 GiB but 50.00 GiB is free" in reason


def test_explicit_utilization_above_free_is_refused_with_the_value_that_fits() -> None:
    info = model_info("llama-3.1-8b")
    args = EngineArgs(max_model_len=4096, gpu_memory_utilization=0.9)
    with pytest.raises(PlanError) as error:
        auto_fit(info, args, [busy_gpu(79.19, 50.0)], frozenset({"gpu_memory_utilization"}))
    assert error.value.kind == "gpu_memory_utilization"
    assert str(error.value) == (
        "gpu_memory_utilization=0.9 asks for 71.27 GiB of GPU 0 (NVIDIA H100, 79.19 GiB, SM 9.0) but only "
        "50.00 GiB is free (other processes hold 29.19 GiB): set --gpu-memory-utilization 0.63 or lower, "
        "or stop the other processes"
    )


def test_weights_that_do_not_fit_name_each_fix_and_each_fix_fits() -> None:
    with pytest.raises(PlanError) as error:
        fit("llama-3.3-70b", "1x24@8.6")
    assert error.value.kind == "weights"
    message = str(error.value)
    assert message.startswith(
        "the weights do not fit on GPU 0 (assumed GPU, 24.00 GiB, SM 8.6): 131.42 GiB per GPU"
    )
    assert re.search(r"113\.\d\d GiB short", message)
    combo = re.search(
        r"--quantization awq or gptq \(an AWQ or GPTQ checkpoint of the model\) "
        r"with --cpu-offload-gb ([\d.]+) ",
        message,
    )
    bnb = re.search(r"--quantization bitsandbytes with --cpu-offload-gb ([\d.]+) ", message)
    assert combo and bnb
    assert "--tensor-parallel-size 8 (8 GPUs like this one; this plan has 1)" in message
    assert_runnable_first(message)
    # applying a named fix makes the plan fit; half a GiB less offload does not (with the knobs the
    # suggestion was sized with, set explicitly so that auto-fit does not shrink them)
    knobs = {
        "max_model_len": 4096,
        "max_num_batched_tokens": 8192,
        "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, *range(8, 257, 8)]},
    }
    for method, offload in (("awq", float(combo[1])), ("bitsandbytes", float(bnb[1]))):
        fitted = fit("llama-3.3-70b", "1x24@8.6", SEQS, quantization=method, cpu_offload_gb=offload, **knobs)
        assert fitted.plan.kv_cache_tokens >= 4096
        with pytest.raises(PlanError):
            fit("llama-3.3-70b", "1x24@8.6", SEQS, quantization=method, cpu_offload_gb=offload - 0.5, **knobs)
    fit("llama-3.3-70b", "8x24@8.6", tensor_parallel_size=8, max_model_len=4096)


VLLM_ONLY = {
    "--quantization": " (fitserve runs int4, fp8 and bitsandbytes, not this method yet; vLLM does)",
}


RUNS_INT4_CHECKPOINT = re.compile(
    r"--quantization (awq or gptq \(4-bit|fp8 \(8-bit|bitsandbytes \(4-bit nf4)[^)]*\): "
    r"|--quantization (fp8|awq or gptq \(an AWQ or GPTQ checkpoint of the model\)|bitsandbytes) with "
)


def assert_runnable_first(message: str) -> None:
    """Every suggested line that fitserve's engine refuses says so at its end, and none comes before a
    line fitserve runs."""
    lines = message.split("What would fit (any one line):\n", 1)[1].splitlines()
    options = [line.strip() for line in lines]
    # fitserve runs an int4 AWQ / GPTQ checkpoint and --quantization fp8 on their own: those are runnable
    refused = [
        any(o.startswith(flag) for flag in VLLM_ONLY) and not RUNS_INT4_CHECKPOINT.match(o) for o in options
    ]
    for option, is_refused in zip(options, refused):
        if is_refused:
            flag = next(flag for flag in VLLM_ONLY if option.startswith(flag))
            assert option.endswith(VLLM_ONLY[flag]), option
        else:
            assert not any(reason in option for reason in VLLM_ONLY.values()), option
    assert refused == sorted(refused), options  # runnable (False) before refused (True)


def test_the_settings_called_vllm_only_are_the_ones_fitserve_refuses() -> None:
    """When fitserve starts running one of them, this fails: drop it from NOT_RUN_BY_FITSERVE."""
    asked = {
        "quantization": {"quantization": "fbgemm_fp8"},
    }
    assert set(asked) == set(NOT_RUN_BY_FITSERVE)
    for setting, change in asked.items():
        with pytest.raises(ValueError, match="not supported yet"):
            create_engine_config(EngineArgs(**change))  # type: ignore[arg-type]
        assert NOT_RUN_BY_FITSERVE[setting].endswith("; vLLM does")


def test_refusals_that_name_a_vllm_only_fix_say_so() -> None:
    with pytest.raises(PlanError) as capability:
        fit("llama-3.1-8b", "1x80@7.0", quantization="fp8", max_model_len=4096)
    assert str(capability.value).endswith(
        "the GPU has 7.0: use a 4-bit AWQ or GPTQ checkpoint of the model instead (fitserve runs those)"
    )
    with pytest.raises(PlanError) as host:
        args = EngineArgs(cpu_offload_gb=8, max_model_len=4096)
        auto_fit(model_info("llama-3.1-8b"), args, parse_assume_gpus("1x24@8.9"), host_ram_available=4 * GiB)
    assert str(host.value).endswith(
        "lower --cpu-offload-gb, or add --quantization fp8 or bitsandbytes (or use an int4 checkpoint) to "
        "shrink the weights"
    )


def test_quantization_alone_is_offered_when_it_fits() -> None:
    with pytest.raises(PlanError) as error:
        fit("llama-3.1-8b", "1x16@8.9")
    message = str(error.value)
    assert (
        "--quantization fp8 (8-bit, quantized from this checkpoint while loading): weights 8.46 GiB"
        in message
    )
    assert (
        "--quantization awq or gptq (4-bit, needs an AWQ or GPTQ checkpoint of the model): weights 5.33"
        in message
    )
    assert "--tensor-parallel-size 2 (2 GPUs like this one; this plan has 1)" in message
    assert "with --cpu-offload-gb" not in message  # quantization alone fits: no combinations offered
    assert_runnable_first(message)


def test_explicit_settings_win_over_auto_fit() -> None:
    explicit = frozenset({"max_num_seqs"})
    result = fit("llama-3.1-8b", "1x20@8.9", explicit, max_num_seqs=512, max_num_batched_tokens=8192)
    assert result.plan.inputs.max_num_seqs == 512
    assert choice(result, "max_num_seqs") == (512, "set by you")
    assert choice(result, "max_num_batched_tokens") == (8192, "set by you")


def test_unset_knobs_shrink_to_leave_room_for_the_kv_cache() -> None:
    """Graphs go first, then the step's tokens; once a request fits, the graphs the token step made
    needless come back: here sizes up to 64 (all of them, or eager, would not leave the room)."""
    result = fit("llama-3.1-8b", "1x18.1@8.9")
    inputs = result.plan.inputs
    assert inputs.max_num_batched_tokens == 4096 and max(inputs.cudagraph_capture_sizes) == 64
    sizes, reason = choice(result, "cudagraph_capture_sizes")
    assert re.fullmatch(
        r"lowered to leave the KV cache room for a 4,096-token request \(frees 0\.\d\d GiB\)", reason
    )
    assert choice(result, "max_num_batched_tokens")[1].startswith("lowered to leave the KV cache room")
    assert result.plan.kv_cache_tokens >= 4096
    # graphs up to 128 beside the same step would not leave it
    ladder = [*sizes, 72, 80, 88, 96, 104, 112, 120, 128]
    more = fit("llama-3.1-8b", "1x18.1@8.9", SEQS, max_num_batched_tokens=4096, max_num_seqs=256,
               compilation_config={"cudagraph_capture_sizes": ladder})  # fmt: skip
    assert more.plan.kv_cache_tokens < 4096
    # the defaults would not have left room for one 4096-token request
    with pytest.raises(PlanError):
        fit(
            "llama-3.1-8b",
            "1x18.1@8.9",
            SEQS,
            max_model_len=4096,
            max_num_batched_tokens=8192,
            enforce_eager=True,
        )


def test_max_num_seqs_capped_by_the_kv_blocks() -> None:
    result = fit("qwen3-0.6b", "1x2.0@8.9", max_model_len=512, max_num_batched_tokens=512)
    seqs, reason = choice(result, "max_num_seqs")
    blocks = result.plan.num_kv_blocks - 1
    assert seqs <= blocks < 256
    expected = f"lowered from 256 to {seqs}: the KV cache has {blocks} blocks and every running request holds"
    assert reason == f"{expected} at least one"
    assert all(size <= seqs for size in result.plan.inputs.cudagraph_capture_sizes)
    # the largest such count: one more sequence would need more blocks than its plan leaves
    more = fit(
        "qwen3-0.6b", "1x2.0@8.9", SEQS, max_model_len=512, max_num_batched_tokens=512, max_num_seqs=seqs + 1
    )
    assert more.plan.num_kv_blocks - 1 < seqs + 1


def test_tensor_parallel_checks() -> None:
    with pytest.raises(PlanError, match=r"tensor_parallel_size=2 needs 2 GPUs, the plan has 1: set --tensor"):
        fit("llama-3.1-8b", tensor_parallel_size=2)
    with pytest.raises(
        PlanError, match=r"tensor_parallel_size=3 does not divide the model's 32 attention heads"
    ):
        fit("llama-3.1-8b", "4x80", tensor_parallel_size=3)
    result = fit("qwen3-8b", "2x20@8.9", tensor_parallel_size=2)
    assert result.plan.inputs.max_model_len == 40960
    assert result.notes == ()
    assert choice(result, "tensor_parallel_size") == (2, "set by you")


def test_unused_gpus_are_noted() -> None:
    result = fit("qwen3-8b", "2x20@8.9", frozenset({"tensor_parallel_size"}), tensor_parallel_size=1)
    (note,) = [n for n in result.notes if n.startswith("2 GPUs present")]
    assert re.fullmatch(r"2 GPUs present, .* --tensor-parallel-size 2 would give [\d,]+ KV tokens", note)


def test_cpu_plan_and_host_memory_refusal() -> None:
    cpu = DeviceSpec("cpu", 0, "CPU (2 cores, 16.0 GiB RAM)", 16 * GiB, 12 * GiB)
    result = auto_fit(model_info("qwen3-0.6b"), EngineArgs(), [cpu])
    assert choice(result, "dtype")[0] == "float32"
    assert result.plan.inputs.max_num_batched_tokens == 2048
    # --cpu-kv-cache-space unset: 2 requests of the model's own 40,960 tokens (17.5 GiB) are more than half
    # of the 9.78 GiB the 2.22 GiB of weights leave, so max_model_len is lowered until 2 fit in that half
    plan = result.plan
    half = (12 * GiB - plan.terms.weights) // 2
    assert plan.inputs.max_model_len == (half // plan.block_bytes - 1) // 2 * 16 == 11_424  # 1 null block
    assert plan.kv_cache_tokens == 2 * 11_424 and plan.kv_cache_bytes <= half
    assert (
        "lowered to the largest length that 2 requests fit; on the CPU the KV cache takes at most 50%"
        in (choice(result, "max_model_len")[1])
    )
    small = DeviceSpec("cpu", 0, "CPU", 4 * GiB, 3 * GiB)
    with pytest.raises(PlanError) as error:
        auto_fit(model_info("qwen3-0.6b"), EngineArgs(), [small])
    assert error.value.kind == "host_memory"
    # weights and activations alone are over the 3 GiB: only bfloat16 weights fit, so only that is named
    assert re.search(
        r"needs [\d.]+ GiB of RAM .* but 3\.00 GiB is available: any one of: "
        r"--dtype bfloat16 \(weights 1\.11 GiB;",
        str(error.value),
    )
    assert "--cpu-kv-cache-space" not in str(error.value)


def test_serving_plans_short_prefill_chunks_on_a_gpu_only() -> None:
    served = fit("llama-3.1-8b", max_model_len=4096, serving=True)
    assert served.plan.inputs.max_num_batched_tokens == 1024
    value, reason = choice(served, "max_num_batched_tokens")
    assert value == 1024 and reason.startswith("default for serving")
    # the smaller step leaves more memory to the KV cache than the offline default
    assert served.plan.kv_cache_tokens > fit("llama-3.1-8b", max_model_len=4096).plan.kv_cache_tokens
    # never below max_num_seqs (one token each), and an explicit value wins
    many_seqs = fit("llama-3.1-8b", max_model_len=4096, max_num_seqs=2048, serving=True)
    assert many_seqs.plan.inputs.max_num_batched_tokens == 2048
    explicit = fit(
        "llama-3.1-8b", H100, frozenset({"max_num_batched_tokens"}), True, max_num_batched_tokens=8192
    )
    assert choice(explicit, "max_num_batched_tokens") == (8192, "set by you")
    cpu = DeviceSpec("cpu", 0, "CPU (2 cores, 16.0 GiB RAM)", 16 * GiB, 12 * GiB)
    on_cpu = auto_fit(model_info("qwen3-0.6b"), EngineArgs(device="cpu"), [cpu], serving=True)
    assert on_cpu.plan.inputs.max_num_batched_tokens == 2048


def test_fp8_kv_cache_is_planned_from_sm_7_0_and_refused_below() -> None:
    with pytest.raises(PlanError) as error:
        fit("llama-3.1-8b", "1x24@6.1", kv_cache_dtype="fp8")
    assert error.value.kind == "kv_cache_dtype"
    assert "need compute capability 7.0; this GPU has 6.1: run on a GPU" in str(error.value)
    # e4m3 below 8.9: the kernels convert its bits
    assert fit("llama-3.1-8b", "1x24@8.6", kv_cache_dtype="fp8").plan.kv_cache_tokens > 0
    assert fit("llama-3.1-8b", "1x24@8.6", kv_cache_dtype="fp8_e5m2").plan.kv_cache_tokens > 0
    assert fit("llama-3.1-8b", "1x24@8.9", kv_cache_dtype="fp8").plan.kv_cache_tokens > 0


def test_a_hybrid_lowers_its_sequences_and_keeps_its_graphs(capsys) -> None:
    """Qwen3.6-35B-A3B int4 on a 32 GB GPU: its DeltaNet state (61.4 MiB a sequence) makes max_num_seqs the
    knob that frees most; once lowered, the CUDA graphs and the step's tokens dropped before it come back."""
    from fitserve.cli.plan import run_plan
    from tests.unit.test_planner_cli import parse

    folder = Path(__file__).resolve().parents[2] / "examples" / "models" / "qwen3.6-35b-a3b-awq"
    assert run_plan(parse("plan", [str(folder), "--assume-gpus", "1x32@8.6"])) == 0
    out = capsys.readouterr().out
    assert re.search(r"max_num_seqs +64 +lowered to leave the KV cache room", out), out
    assert re.search(r"cudagraph_capture_sizes +11 sizes 1-64 +vLLM's ladder up to max_num_seqs 64", out), out
    assert re.search(r"max_num_batched_tokens +1024 +default", out), out


def test_a_hybrids_options_count_the_sequences_auto_fit_would_drop() -> None:
    """Qwen3.6-35B-A3B in bf16 on a 32 GB GPU: an int4 checkpoint fits only with fewer sequences (each holds
    a 61.4 MiB state slot), and CPU offload needs less with them, as auto-fit would run it when max_num_seqs
    is unset; set by the user, the int4 line is not offered and the offload line keeps 256 sequences."""
    from fitserve.cli.plan import run_plan
    from fitserve.planner.fit_errors import PlanError
    from tests.unit.test_planner_cli import parse

    folder = str(Path(__file__).resolve().parents[2] / "examples" / "models" / "qwen3.6-35b-a3b")
    with pytest.raises(PlanError) as error:
        run_plan(parse("plan", [folder, "--assume-gpus", "1x32@8.6"]))
    lines = [line.strip() for line in str(error.value).splitlines()]
    awq = [line for line in lines if line.startswith("--quantization awq")]
    assert len(awq) == 1 and awq[0].endswith("KV tokens, max_num_seqs lowered to 128"), awq
    (offload,) = [line for line in lines if line.startswith("--cpu-offload-gb")]
    assert re.search(r"KV tokens, max_num_seqs lowered to \d+$", offload), offload
    with pytest.raises(PlanError) as error:
        run_plan(parse("plan", [folder, "--assume-gpus", "1x32@8.6", "--max-num-seqs", "256"]))
    assert "--quantization awq" not in str(error.value) and "lowered to" not in str(error.value)
    at_256 = [line.strip() for line in str(error.value).splitlines()]
    (offload_at_256,) = [line for line in at_256 if line.startswith("--cpu-offload-gb")]
    gib = [float(line.split("--cpu-offload-gb ")[1].split()[0]) for line in (offload, offload_at_256)]
    assert gib[0] < gib[1]  # fewer state slots: less to offload
