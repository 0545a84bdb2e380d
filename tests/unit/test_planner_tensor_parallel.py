"""Tensor parallel in the planner: auto-fit's size on several GPUs, the refusals before loading (GPUs that
differ, more ranks than GPUs, sizes the heads do not take), and CPU ranks planned per rank."""

from __future__ import annotations

import logging

import pytest

from fitserve.args import EngineArgs
from fitserve.args_support import refuse_unsupported
from fitserve.cpu_kv_cache import RAM_FRACTION, check_fits_in_ram, cpu_kv_cache_size
from fitserve.planner.fit import FitResult, PlanError, auto_fit
from fitserve.planner.fit_parallel import AUTO_TP_REQUESTS, auto_sizes, size_refusal, working_sizes
from fitserve.planner.hardware import DeviceSpec, GiB, parse_assume_gpus
from fitserve.planner.memory_estimates import weight_bytes_per_gpu
from fitserve.planner.memory_inputs import with_settings
from fitserve.planner.model_info import inspect_model
from fitserve.planner.report import plan_json, plan_text
from fitserve.planner.resolve import engine_config_from_fit
from tests.unit.planner_helpers import fixture_path, model_info

TP = frozenset({"tensor_parallel_size"})


def fit(
    name: str, gpus: str | list[DeviceSpec], explicit: frozenset[str] = frozenset(), **args: object
) -> FitResult:
    devices = parse_assume_gpus(gpus) if isinstance(gpus, str) else gpus
    return auto_fit(model_info(name), EngineArgs(**args), devices, explicit)  # type: ignore[arg-type]


def tp_choice(result: FitResult) -> tuple[object, str, bool]:
    (found,) = [c for c in result.choices if c.setting == "tensor_parallel_size"]
    return found.value, found.reason, found.explicit


def gpu(index: int, name: str, total_gib: float, capability: tuple[int, int] = (9, 0)) -> DeviceSpec:
    """A GPU as the probe reports it (not assumed): the fixes then name CUDA_VISIBLE_DEVICES."""
    total = int(total_gib * GiB)
    return DeviceSpec("cuda", index, name, total, total, capability)


CPU = DeviceSpec("cpu", 0, "CPU (2 cores, 16.0 GiB RAM)", 16 * GiB, 12 * GiB)


# ---- auto-fit's size -------------------------------------------------------------------------------------


def test_auto_keeps_one_gpu_when_it_holds_a_useful_batch() -> None:
    result = fit("llama-3.1-8b", "2x80@9.0")
    assert result.plan.inputs.tensor_parallel_size == 1
    assert result.devices == parse_assume_gpus("2x80@9.0")[:1]
    size, reason, explicit = tp_choice(result)
    assert (size, explicit) == (1, False)
    assert reason.startswith("one GPU holds the weights (14.96 GiB) and ")
    assert f"(at least {AUTO_TP_REQUESTS} wanted); the other GPU stays unused" in reason
    assert result.choices[0].setting == "tensor_parallel_size"  # it shapes every other choice


def test_auto_takes_two_gpus_when_the_weights_leave_one_no_room() -> None:
    result = fit("llama-3.1-8b", "2x16@8.9")
    plan = result.plan
    assert plan.inputs.tensor_parallel_size == 2 and len(result.devices) == 2
    size, reason, explicit = tp_choice(result)
    assert (size, explicit) == (2, False)
    assert reason.startswith(
        "the weights (14.96 GiB) leave one GPU no room for a 4,096-token request; 2 GPUs hold 7.48 GiB of "
        "weights each and "
    )
    assert plan.kv_cache_tokens >= AUTO_TP_REQUESTS * 4096
    # one 16 GiB GPU does not fit the 8B model at all
    with pytest.raises(PlanError) as error:
        fit("llama-3.1-8b", "2x16@8.9", TP, tensor_parallel_size=1)
    assert error.value.kind == "weights"
    assert "--tensor-parallel-size 2 (2 GPUs like this one): weights 7.48 GiB per GPU" in str(error.value)
    assert "fitserve does not run tensor parallel" not in str(error.value)
    assert "tensor_parallel_size = 2 (auto-fit: the weights (14.96 GiB)" in result.choices[0].log_line()


def test_auto_widens_when_one_gpu_holds_too_small_a_batch() -> None:
    result = fit("llama-3.1-8b", "2x19@8.9")
    size, reason, _ = tp_choice(result)
    assert size == 2
    assert reason.startswith("on one GPU the weights (14.96 GiB) leave ")
    assert f"(fewer than {AUTO_TP_REQUESTS} wanted); 2 GPUs hold 7.48 GiB of weights each" in reason


def test_auto_takes_the_smallest_size_that_fits() -> None:
    assert fit("llama-3.1-8b", "4x16@8.9").plan.inputs.tensor_parallel_size == 2
    assert fit("llama-3.3-70b", "8x24@8.6", max_model_len=4096).plan.inputs.tensor_parallel_size == 8


def test_one_gpu_and_the_cpu_stay_at_one_without_a_choice() -> None:
    for devices in (parse_assume_gpus("1x80@9.0"), [CPU]):
        result = auto_fit(model_info("qwen3-0.6b"), EngineArgs(), devices)
        assert result.plan.inputs.tensor_parallel_size == 1
        assert all(c.setting != "tensor_parallel_size" for c in result.choices)


def test_an_explicit_size_wins_and_unused_gpus_are_noted() -> None:
    result = fit("llama-3.1-8b", "2x20@8.9", TP, tensor_parallel_size=1)
    assert tp_choice(result) == (1, "set by you", True)
    assert any(n.startswith("2 GPUs present, tensor_parallel_size 1 uses 1") for n in result.notes)
    assert tp_choice(fit("llama-3.1-8b", "4x80@9.0", tensor_parallel_size=4)) == (4, "set by you", True)


def test_auto_never_pairs_unlike_gpus() -> None:
    unlike = [gpu(0, "NVIDIA L4", 16), gpu(1, "NVIDIA H100", 79.19)]
    assert auto_sizes(model_info("llama-3.1-8b").shape, unlike) == [1]
    with pytest.raises(PlanError) as error:  # one 16 GiB GPU is all it may use
        fit("llama-3.1-8b", unlike)
    assert error.value.kind == "weights"


def test_auto_sizes_are_powers_of_two_the_heads_take() -> None:
    shape = model_info("deepseek-r1-distill-qwen-7b").shape  # 28 attention heads, 4 KV heads
    assert auto_sizes(shape, parse_assume_gpus("8x24")) == [1, 2, 4]
    assert working_sizes(shape, 28) == [1, 2, 4, 28]


def test_the_auto_size_reaches_the_engine_config() -> None:
    model = inspect_model(fixture_path("qwen3-8b"), load_format="dummy")
    args = EngineArgs(model=fixture_path("qwen3-8b"), load_format="dummy")
    result = auto_fit(model, args, parse_assume_gpus("2x16@8.9"))
    assert result.plan.inputs.tensor_parallel_size == 2
    config = engine_config_from_fit(args, result)
    assert config.parallel.tensor_parallel_size == 2
    assert tp_choice(result)[0] in {c.value for c in config.choices if c.setting == "tensor_parallel_size"}


# ---- refusals before loading -----------------------------------------------------------------------------


def test_gpus_that_differ_are_refused_with_alike_ones_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpus = [gpu(0, "NVIDIA H100", 79.19), gpu(1, "NVIDIA A10", 22.06, (8, 6)), gpu(2, "NVIDIA H100", 79.19)]
    with pytest.raises(PlanError) as error:
        fit("llama-3.1-8b", gpus, TP, tensor_parallel_size=2)
    assert error.value.kind == "devices"
    assert str(error.value) == (
        "tensor_parallel_size=2 needs 2 alike GPUs (each rank is planned alike), but GPU 0 (NVIDIA H100, "
        "79.19 GiB, SM 9.0) and GPU 1 (NVIDIA A10, 22.06 GiB, SM 8.6) differ: set CUDA_VISIBLE_DEVICES=0,2 "
        "(alike GPUs), or --tensor-parallel-size 1 (the alike GPUs first in the list)"
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,7")  # torch numbers the GPUs it lists from 0
    with pytest.raises(PlanError, match=r"set CUDA_VISIBLE_DEVICES=4,7 \(alike GPUs\)"):
        fit("llama-3.1-8b", gpus, TP, tensor_parallel_size=2)
    # the same model and memory under another name is not alike either; assumed GPUs name --assume-gpus
    with pytest.raises(PlanError, match=r"differ: plan for alike GPUs with --assume-gpus 2x80$"):
        fit("llama-3.1-8b", "1x80,1x40", tensor_parallel_size=2)


def test_more_ranks_than_gpus_names_both_numbers_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [gpu(0, "NVIDIA H100", 79.19), gpu(1, "NVIDIA H100", 79.19)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with pytest.raises(PlanError) as error:
        fit("llama-3.1-8b", gpus, tensor_parallel_size=4)
    assert str(error.value) == (
        "tensor_parallel_size=4 needs 4 GPUs, torch sees 2 (CUDA_VISIBLE_DEVICES=2,3): set "
        "--tensor-parallel-size 2 or less, or make 4 GPUs visible (CUDA_VISIBLE_DEVICES lists them)"
    )
    with pytest.raises(
        PlanError, match=r"needs 8 GPUs, the plan has 2: set --tensor-parallel-size 2 or less, "
    ):
        fit("llama-3.1-8b", "2x80", tensor_parallel_size=8)


def test_sizes_the_heads_do_not_take_are_refused_with_the_nearest_that_do() -> None:
    with pytest.raises(PlanError) as heads:
        fit("llama-3.1-8b", "8x80", tensor_parallel_size=3)
    assert str(heads.value) == (
        "tensor_parallel_size=3 does not divide the model's 32 attention heads: set --tensor-parallel-size "
        "2 or 4 (the nearest that work)"
    )
    with pytest.raises(PlanError) as kv_heads:  # 28 attention heads, 4 KV heads: 7 divides 28, not 4
        fit("deepseek-r1-distill-qwen-7b", "8x80", tensor_parallel_size=7)
    assert str(kv_heads.value) == (
        "tensor_parallel_size=7 is neither a divisor nor a multiple of the model's 4 KV heads: set "
        "--tensor-parallel-size 4 or 28 (the nearest that work)"
    )
    assert kv_heads.value.kind == "devices"
    # the same refusals on the CPU, before anything else is planned
    with pytest.raises(PlanError, match=r"^tensor_parallel_size=3 does not divide"):
        auto_fit(model_info("llama-3.1-8b"), EngineArgs(tensor_parallel_size=3), [CPU])
    assert size_refusal(model_info("llama-3.3-70b").shape, 16) is None  # 16 ranks, 8 KV heads replicated


def test_the_engine_args_accept_tensor_parallel_and_the_mp_backend(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="fitserve.args"):
        refuse_unsupported(EngineArgs(tensor_parallel_size=2, distributed_executor_backend="mp"))
    assert (
        "--distributed-executor-backend mp: fitserve runs one process per tensor-parallel rank" in caplog.text
    )
    refuse_unsupported(EngineArgs(tensor_parallel_size=2, distributed_executor_backend="ray"))  # Ray actors
    launcher = "external_launcher"
    with pytest.raises(ValueError, match=rf"^not supported yet: --distributed-executor-backend {launcher}"):
        refuse_unsupported(EngineArgs(tensor_parallel_size=2, distributed_executor_backend=launcher))
    with pytest.raises(ValueError, match=r"^not supported yet: --distributed-executor-backend uni"):
        refuse_unsupported(EngineArgs(tensor_parallel_size=2, distributed_executor_backend="uni"))
    refuse_unsupported(EngineArgs(distributed_executor_backend="uni"))  # one rank: one process


# ---- CPU ranks -------------------------------------------------------------------------------------------


def test_cpu_ranks_are_planned_per_rank() -> None:
    one = auto_fit(model_info("qwen3-0.6b"), EngineArgs(max_model_len=4096), [CPU])
    two = auto_fit(model_info("qwen3-0.6b"), EngineArgs(max_model_len=4096, tensor_parallel_size=2), [CPU])
    plan = two.plan
    assert plan.inputs.tensor_parallel_size == 2 and two.devices == (CPU,)
    assert plan.budget_bytes == CPU.free_bytes // 2  # each rank's share of the RAM available
    assert plan.terms.weights == weight_bytes_per_gpu(plan.inputs)
    assert plan.terms.weights < 0.6 * one.plan.terms.weights  # 1/2 of the split weights, norms whole
    assert plan.kv_bytes_per_token * 2 == one.plan.kv_bytes_per_token  # half the 8 KV heads each
    size = plan.cpu_kv
    assert size is not None and size.ranks == 2
    assert size.available_bytes == CPU.free_bytes - 2 * plan.terms.weights  # what every rank's weights leave
    assert size.cap_blocks == int(size.available_bytes * RAM_FRACTION) // 2 // plan.block_bytes
    assert size.log_line().startswith("cpu_kv_cache_space = ") and " per rank (2 ranks) " in size.log_line()
    assert plan.kv_cache_tokens == one.plan.kv_cache_tokens  # the same requests, half the bytes per rank
    assert tp_choice(two) == (
        2,
        "set by you: 2 CPU ranks (processes, gloo), each holding 1/2 of the weights and of the KV heads, "
        "sharing the RAM",
        True,
    )
    assert any(
        note.startswith("tensor_parallel_size 2 on the CPU: 2 ranks (processes)") for note in two.notes
    )


def test_cpu_ranks_split_the_ram_cap() -> None:
    small = DeviceSpec("cpu", 0, "CPU (2 cores, 8.0 GiB RAM)", 8 * GiB, 5 * GiB)
    with pytest.raises(PlanError) as error:  # each rank has its own activations and runtime
        auto_fit(model_info("qwen3-0.6b"), EngineArgs(tensor_parallel_size=2), [small])
    assert error.value.kind == "host_memory"
    assert str(error.value).startswith("each of the 2 CPU ranks needs 2.69 GiB of RAM (weights 1.11, ")
    assert "but its share of the RAM available is 2.50 GiB (5.00 GiB / 2): any one of: " in str(error.value)
    assert str(error.value).endswith(
        "; or a smaller --tensor-parallel-size (each rank has its own activations and runtime)"
    )
    auto_fit(model_info("qwen3-0.6b"), EngineArgs(), [small])  # one rank fits
    roomier = DeviceSpec("cpu", 0, "CPU (2 cores, 16.0 GiB RAM)", 16 * GiB, 10 * GiB)
    result = auto_fit(model_info("qwen3-0.6b"), EngineArgs(tensor_parallel_size=2), [roomier])
    size = result.plan.cpu_kv
    assert size is not None and size.cap_blocks is not None and "split between 2 ranks" in size.reason
    (length_reason,) = [c.reason for c in result.choices if c.setting == "max_model_len"]
    assert length_reason.endswith("of RAM the weights leave, split between 2 ranks")
    one_rank = cpu_kv_cache_size(
        None,
        max_model_len=40960,
        max_num_batched_tokens=2048,
        max_num_seqs=256,
        block_size=16,
        kv_bytes_per_token=1024,
        available_bytes=4 * GiB,
    )
    two_ranks = cpu_kv_cache_size(
        None,
        max_model_len=40960,
        max_num_batched_tokens=2048,
        max_num_seqs=256,
        block_size=16,
        kv_bytes_per_token=1024,
        available_bytes=4 * GiB,
        ranks=2,
    )
    assert two_ranks.cap_blocks == one_rank.cap_blocks // 2


def test_an_explicit_cpu_kv_cache_space_is_each_ranks() -> None:
    check_fits_in_ram(4, 9 * GiB, ranks=2)
    with pytest.raises(ValueError) as error:
        check_fits_in_ram(4, 7 * GiB, ranks=2)
    assert str(error.value).startswith(
        "cpu_kv_cache_space=4 GiB (2 ranks x 4 GiB) is more than the 7.00 GiB of RAM available: set "
        "--cpu-kv-cache-space 1.75 or less"
    )
    result = auto_fit(
        model_info("qwen3-0.6b"),
        EngineArgs(tensor_parallel_size=2, cpu_kv_cache_space=1, max_model_len=4096),
        [CPU],
    )
    assert result.plan.kv_cache_bytes <= GiB
    assert result.plan.cpu_kv is not None and result.plan.cpu_kv.reason.startswith("set by you per rank: ")


# ---- the report ------------------------------------------------------------------------------------------


def test_the_report_says_per_rank_and_shows_the_auto_choice() -> None:
    result = fit("llama-3.1-8b", "2x16@8.9")
    text = plan_text(result)
    assert "  tensor_parallel_size     2               the weights (14.96 GiB) leave one GPU" in text
    assert text.count("tensor_parallel_size     2") == 1
    assert "Memory per GPU (each of the 2 tensor-parallel ranks)" in text
    assert "weights (8.03 B params, bfloat16, 1/2 per GPU)" in text
    assert "x 4 KV heads x 128 x 2 bytes per GPU (8 KV heads over 2 ranks)" in text
    data = plan_json(result)
    assert data["tensor_parallel_size"] == 2 and data["settings"]["tensor_parallel_size"] == 2
    assert data["choices"][0]["setting"] == "tensor_parallel_size" and not data["choices"][0]["explicit"]
    cpu_text = plan_text(auto_fit(model_info("qwen3-0.6b"), EngineArgs(tensor_parallel_size=2), [CPU]))
    assert "Memory per rank (each of 2 CPU ranks, in host RAM)" in cpu_text
    assert "RAM available / 2 ranks (12.00 GiB in all)" in cpu_text
    assert "weights (0.60 B params, float32, 1/2 per rank)" in cpu_text
    one = with_settings(result.plan.inputs, tensor_parallel_size=1)
    assert weight_bytes_per_gpu(one) / GiB == pytest.approx(14.96, abs=0.01)


def test_data_parallel_plans_each_engine_on_its_share_of_the_gpus() -> None:
    # 4 x 19 GiB and two engines: each plans on 2 GPUs, where the 8B model needs both (TP 2)
    result = fit("llama-3.1-8b", "4x19", data_parallel_size=2)
    assert result.plan.inputs.tensor_parallel_size == 2
    assert any(
        note.startswith(
            "data_parallel_size 2: `fitserve serve` runs 2 engines like this one, each on 2 GPU(s) of "
            "its own (4 in all)"
        )
        for note in result.notes
    )
    assert not any("GPUs present" in note for note in result.notes)
