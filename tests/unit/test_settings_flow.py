"""One way settings flow: `LLM()`, `fitserve serve` and `fitserve generate` resolve the same flags into the
same EngineConfig (auto-fit's choices included), and every setting the log prints as chosen is the value
the config holds, so the value the engine runs with."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest

from fitserve.args import EngineArgs, engine_args_from_kwargs
from fitserve.capture_sizes import default_capture_sizes
from fitserve.cli.main import parse_command
from fitserve.config import Choice, EngineConfig
from fitserve.engine.llm import LLM
from fitserve.planner import resolve
from fitserve.planner.hardware import parse_assume_gpus
from fitserve.planner.resolve import create_engine_config
from tests.paths import SMOLLM2_TOKENIZER_DIR
from tests.unit.model_helpers import build_hf_model, tiny_hf_config
from tests.unit.planner_helpers import fixture_path


def resolved_value(config: EngineConfig, setting: str) -> Any:
    """Where the engine reads each setting auto-fit prints; a printed setting missing here fails."""
    values = {
        "dtype": str(config.model.dtype).removeprefix("torch."),
        "gpu_memory_utilization": config.cache.gpu_memory_utilization,
        "max_model_len": config.scheduler.max_model_len,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "cudagraph_capture_sizes": config.compilation.cudagraph_capture_sizes,
        "kv_cache_dtype": config.cache.kv_cache_dtype,
        "tensor_parallel_size": config.parallel.tensor_parallel_size,
    }
    assert setting in values, f"auto-fit prints {setting} but nothing in EngineConfig carries it"
    return values[setting]


def without_reasons(config: EngineConfig) -> tuple[EngineConfig, tuple[tuple[str, Any, bool], ...]]:
    """The config, and its choices without their reasons (which quote the RAM free at that moment)."""
    choices = tuple((c.setting, c.value, c.explicit) for c in config.choices)
    return dataclasses.replace(config, choices=()), choices


def serve_config(argv: list[str]) -> EngineConfig:
    """The config `fitserve serve ARGV` starts its engine with (cli.main.run_serve -> run_server)."""
    command, _, namespace = parse_command(["serve", *argv])
    assert command == "serve"
    return create_engine_config(EngineArgs.from_cli(namespace), serving=True)


def generate_config(argv: list[str]) -> EngineConfig:
    """The config `fitserve generate ARGV` builds its LLM with (cli.generate.run_generate)."""
    _, _, namespace = parse_command(["generate", *argv])
    return create_engine_config(EngineArgs.from_cli(namespace))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    build_hf_model(tiny_hf_config("Qwen3ForCausalLM"), seed=0).save_pretrained(folder)
    return str(folder)


def test_llm_serve_and_generate_resolve_one_config_on_the_cpu(tiny_model: str) -> None:
    flags = ["--device", "cpu", "--max-num-seqs", "8", "--block-size", "8", "--tokenizer", TOKENIZER]
    served = serve_config([tiny_model, *flags])
    generated = generate_config([tiny_model, *flags])
    llm = LLM(tiny_model, device="cpu", max_num_seqs=8, block_size=8, tokenizer=TOKENIZER)
    assert without_reasons(llm.engine.config) == without_reasons(served) == without_reasons(generated)
    assert served.explicit == {"model", "device", "max_num_seqs", "block_size", "tokenizer"}
    # the engine runs what the config says
    assert llm.engine.scheduler.config == served.scheduler
    assert llm.engine.kv_manager.pool.num_blocks == llm.engine.memory_plan.num_kv_blocks


def test_every_choice_printed_is_the_value_the_engine_runs_with(
    tiny_model: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="fitserve"):
        llm = LLM(tiny_model, device="cpu", max_model_len=128, tokenizer=TOKENIZER)
    config = llm.engine.config
    printed = [
        r.getMessage() for r in caplog.records if r.getMessage() in {c.log_line() for c in config.choices}
    ]
    assert printed == [c.log_line() for c in config.choices]
    for choice in config.choices:
        assert resolved_value(config, choice.setting) == choice.value, choice
    assert llm.engine.scheduler.config.max_model_len == 128
    assert next(c for c in config.choices if c.setting == "max_model_len").explicit


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The planner sees GPUs of an --assume-gpus spec; nothing touches CUDA (the config is only built)."""

    def use(spec: str) -> None:
        monkeypatch.setattr(resolve, "probe_gpus", lambda: parse_assume_gpus(spec))

    return use


TOKENIZER = str(SMOLLM2_TOKENIZER_DIR)
QWEN3 = fixture_path("qwen3-0.6b")
LLAMA_8B = fixture_path("llama-3.1-8b")


@pytest.mark.parametrize(
    ("gpu", "model", "flags"),
    [
        ("1x79.19@9.0", QWEN3, {}),
        ("1x79.19@9.0", QWEN3, {"max_num_seqs": 48, "kv_cache_dtype": "fp8"}),
        ("1x24@8.6", LLAMA_8B, {}),  # lowers max_model_len and the graph sizes to fit
        ("1x18.1@8.9", LLAMA_8B, {"max_model_len": 4096}),  # shrinks down to eager
        ("1x16@7.5", QWEN3, {"compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 64, 512]}}),
    ],
)
def test_gpu_choices_are_applied_and_serve_matches_llm(
    one_gpu: Any, gpu: str, model: str, flags: dict[str, Any]
) -> None:
    one_gpu(gpu)
    kwargs = {"load_format": "dummy", **flags}
    for serving in (False, True):
        config = create_engine_config(engine_args_from_kwargs(model, kwargs), serving=serving)
        assert config.device.device == "cuda"
        for choice in config.choices:
            assert resolved_value(config, choice.setting) == choice.value, choice
        sizes = config.compilation.cudagraph_capture_sizes
        assert config.compilation.enforce_eager == (not sizes)
        assert all(size <= config.scheduler.max_num_seqs for size in sizes)
    argv = [model, "--load-format", "dummy"]
    for name, value in flags.items():
        argv += [f"--{name.replace('_', '-')}", str(value).replace("'", '"')]
    explicit_budget = ["--max-num-batched-tokens", "4096"]
    llm_config = create_engine_config(
        engine_args_from_kwargs(model, {**kwargs, "max_num_batched_tokens": 4096})
    )
    assert without_reasons(serve_config([*argv, *explicit_budget])) == without_reasons(llm_config)
    assert without_reasons(generate_config(argv)) == without_reasons(
        create_engine_config(engine_args_from_kwargs(model, kwargs))
    )


def test_serving_differs_from_offline_only_by_its_documented_step_budget(one_gpu: Any) -> None:
    """`fitserve serve` on a GPU takes 1,024-token prefill chunks unless told otherwise (as vLLM's server
    takes a smaller budget than its LLM class); nothing else differs."""
    one_gpu("1x79.19@9.0")
    served = serve_config([QWEN3, "--load-format", "dummy"])
    offline = create_engine_config(engine_args_from_kwargs(QWEN3, {"load_format": "dummy"}))
    assert (served.scheduler.max_num_batched_tokens, offline.scheduler.max_num_batched_tokens) == (1024, 8192)
    same_budget = dataclasses.replace(served.scheduler, max_num_batched_tokens=8192)
    assert dataclasses.replace(served, scheduler=same_budget, choices=()) == dataclasses.replace(
        offline, choices=()
    )


def test_max_logprobs_reaches_the_model_config(one_gpu: Any) -> None:
    one_gpu("1x79.19@9.0")
    assert serve_config([QWEN3, "--load-format", "dummy"]).model.max_logprobs == 20  # vLLM's default
    assert serve_config([QWEN3, "--load-format", "dummy", "--max-logprobs", "-1"]).model.max_logprobs == -1


def test_an_unknown_llm_keyword_names_the_closest_engine_argument() -> None:
    with pytest.raises(
        ValueError, match=r"^'max_model_length' is not an engine argument \(did you mean max_model_len\?\)$"
    ):
        LLM("m", max_model_length=10)


def test_a_choice_names_its_origin() -> None:
    assert (
        Choice("max_num_seqs", 8, "set by you", explicit=True).log_line() == "max_num_seqs = 8 (set by you)"
    )
    assert Choice("dtype", "half", "needed below SM 8.0", explicit=True).origin() == (
        "set by you: needed below SM 8.0"
    )
    assert Choice("max_model_len", 4096, "the model's own").log_line() == (
        "max_model_len = 4096 (auto-fit: the model's own)"
    )


def test_a_fixed_pool_is_a_testing_knob_that_nothing_is_sized_to(one_gpu: Any) -> None:
    """--num-gpu-blocks-override (vLLM's knob for testing preemption): auto-fit neither refuses a
    max_model_len the pool cannot hold nor lowers the graphs, the step budget or max_num_seqs to it."""
    one_gpu("1x79.19@9.0")
    kwargs = {"load_format": "dummy", "num_gpu_blocks_override": 40, "max_model_len": 1024}
    config = create_engine_config(engine_args_from_kwargs(QWEN3, kwargs))
    assert (config.scheduler.max_model_len, config.scheduler.max_num_seqs) == (1024, 256)
    assert config.scheduler.max_num_batched_tokens == 8192
    assert config.compilation.cudagraph_capture_sizes == default_capture_sizes(256)
    unset = create_engine_config(engine_args_from_kwargs(QWEN3, {**kwargs, "max_model_len": None}))
    assert unset.scheduler.max_model_len == 40960  # the model's own
