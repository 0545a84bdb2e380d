"""EngineArgs, its flags and YAML config files: parsing, precedence, typo hints and resolution."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from fitserve.arg_parser import FlexibleArgumentParser, parse_args_with_config
from fitserve.args import EngineArgs, add_engine_args
from fitserve.planner.fit import auto_fit
from fitserve.planner.hardware import DeviceSpec, parse_assume_gpus
from fitserve.planner.model_info import ModelInfo
from fitserve.planner.resolve import create_engine_config
from fitserve.server.args import add_server_args
from tests.paths import FIXTURES_DIR
from tests.unit.planner_helpers import fixture_path

FIXTURES = FIXTURES_DIR
TINY_MAX_POSITIONS = 256


def engine_parser() -> FlexibleArgumentParser:
    return add_engine_args(FlexibleArgumentParser(prog="fitserve test"))


def serve_parser() -> FlexibleArgumentParser:
    return add_server_args(engine_parser())


def write_yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=TINY_MAX_POSITIONS,
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


# ---- YAML config files ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "seed-config-32gb.yaml",
            dict(
                max_num_seqs=256, block_size=32, enforce_eager=False, cpu_offload_gb=20.0, max_model_len=8192
            ),
        ),
        (
            "seed-config-7gb.yaml",
            dict(max_num_seqs=8, block_size=16, enforce_eager=True, cpu_offload_gb=60.0, max_model_len=512),
        ),
    ],
)
def test_fixture_configs_parse_with_typed_values(name: str, expected: dict) -> None:
    namespace = parse_args_with_config(serve_parser(), ["--config", str(FIXTURES / name)])
    assert namespace.port == 6333
    assert namespace.host == "0.0.0.0"
    assert namespace.served_model_name == ["DeepSeek-R1"]
    assert namespace.quantization == "bitsandbytes"
    assert namespace.dtype == "bfloat16"
    assert namespace.trust_remote_code is True
    assert namespace.disable_custom_all_reduce is True
    assert namespace.enable_prefix_caching is True
    for field_name, value in expected.items():
        assert getattr(namespace, field_name) == value, field_name
    assert isinstance(namespace.cpu_offload_gb, float)


@pytest.mark.parametrize("name", ["seed-config-32gb.yaml", "seed-config-7gb.yaml"])
def test_fixture_configs_pass_every_flag_and_stop_at_the_missing_model(name: str) -> None:
    """The seed configs' settings (bitsandbytes with --cpu-offload-gb included) all run: what stops them
    here is their model, a path or hub id of the user's machine."""
    namespace = parse_args_with_config(serve_parser(), ["--config", str(FIXTURES / name)])
    with pytest.raises(ValueError, match=r"DeepSeek-R1-Distill-Llama-70B") as error:
        create_engine_config(EngineArgs.from_cli(namespace))
    assert "not supported yet" not in str(error.value)


def test_fixture_keys_unknown_to_the_engine_are_exactly_the_server_keys() -> None:
    parser = engine_parser()
    engine_keys = {a.dest for a in parser.option_actions()}
    for name in ("seed-config-32gb.yaml", "seed-config-7gb.yaml"):
        keys = {
            str(k).replace("-", "_") for k in yaml.safe_load((FIXTURES / name).read_text(encoding="utf-8"))
        }
        assert keys - engine_keys == {"host", "port", "api_key", "disable_log_requests"}


def test_command_line_wins_over_yaml_and_yaml_over_defaults(tmp_path: Path) -> None:
    config = write_yaml(
        tmp_path, "max-num-seqs: 8\nblock_size: 32\nenforce-eager: true\nmax-model-len: 512\n"
    )
    namespace = parse_args_with_config(
        engine_parser(), ["--config", config, "--max-num-seqs", "3", "--no-enforce-eager"]
    )
    assert namespace.max_num_seqs == 3
    assert namespace.enforce_eager is False
    assert namespace.block_size == 32
    assert namespace.max_model_len == 512
    assert namespace.gpu_memory_utilization == 0.9


def test_config_given_as_equals_and_with_underscore_flag(tmp_path: Path) -> None:
    config = write_yaml(tmp_path, "gpu_memory_utilization: 0.5\n")
    namespace = parse_args_with_config(engine_parser(), [f"--config={config}", "--max_model_len=64"])
    assert namespace.gpu_memory_utilization == 0.5
    assert namespace.max_model_len == 64


def test_dashes_and_underscores_on_the_command_line() -> None:
    parser = engine_parser()
    dashed = parser.parse_args(["--max-num-batched-tokens", "1024", "--no-enable-prefix-caching", "-tp", "1"])
    underscored = parser.parse_args(["--max_num_batched_tokens", "1024", "--no_enable_prefix_caching"])
    assert dashed.max_num_batched_tokens == underscored.max_num_batched_tokens == 1024
    assert dashed.enable_prefix_caching is underscored.enable_prefix_caching is False


def test_unknown_yaml_key_names_the_file_and_the_closest_key(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    config = write_yaml(tmp_path, "max-num-seq: 8\n")
    with pytest.raises(SystemExit) as exit_info:
        parse_args_with_config(engine_parser(), ["--config", config])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"unknown key 'max-num-seq' in --config {config}; did you mean 'max-num-seqs'?" in error


def test_unknown_flag_suggests_the_closest_flag(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        engine_parser().parse_args(["--gpu-memory-utilisation", "0.5"])
    assert "--gpu-memory-utilisation (did you mean --gpu-memory-utilization?)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("block-size: 24\n", "key 'block-size' in --config {path}: 24 is not one of 1, 8, 16, 32, 64, 128"),
        ("max-num-seqs: many\n", "key 'max-num-seqs' in --config {path}: 'many' is not a valid int"),
        ("max-num-seqs: 0.5\n", "key 'max-num-seqs' in --config {path}: 0.5 is not a valid int"),
        ("enforce-eager: 1\n", "key 'enforce-eager' in --config {path}: 1 is not true or false"),
        ("dtype: null\n", "key 'dtype' in --config {path}: null is not allowed here"),
        ("- max-num-seqs\n", "--config {path} must be a mapping of flag names to values, found list"),
    ],
)
def test_bad_yaml_values_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture, yaml_text: str, message: str
) -> None:
    config = write_yaml(tmp_path, yaml_text)
    with pytest.raises(SystemExit):
        parse_args_with_config(engine_parser(), ["--config", config])
    assert message.format(path=config) in capsys.readouterr().err


def test_yaml_values_convert_like_flags(tmp_path: Path) -> None:
    config = write_yaml(
        tmp_path,
        "swap-space: 4\nserved-model-name: [a, b]\ncompilation-config: {cudagraph_capture_sizes: [1, 2]}\n"
        "quantization: null\n",
    )
    namespace = parse_args_with_config(engine_parser(), ["--config", config])
    assert namespace.swap_space == 4.0 and isinstance(namespace.swap_space, float)
    assert namespace.served_model_name == ["a", "b"]
    assert namespace.compilation_config == {"cudagraph_capture_sizes": [1, 2]}
    assert namespace.quantization is None


def test_long_prefill_token_threshold_reaches_the_scheduler(tiny_model: str) -> None:
    namespace = engine_parser().parse_args(["--model", tiny_model, "--long-prefill-token-threshold", "256"])
    assert create_engine_config(EngineArgs.from_cli(namespace)).scheduler.long_prefill_token_threshold == 256
    assert create_engine_config(EngineArgs(model=tiny_model)).scheduler.long_prefill_token_threshold == 0


def test_from_cli_takes_only_engine_fields() -> None:
    namespace = engine_parser().parse_args(["--model", "m", "--max-model-len", "99"])
    namespace.port = 8000
    args = EngineArgs.from_cli(namespace)
    assert args.model == "m" and args.max_model_len == 99
    assert args == EngineArgs(model="m", max_model_len=99)


def test_parser_defaults_equal_the_dataclass_defaults() -> None:
    assert EngineArgs.from_cli(engine_parser().parse_args([])) == EngineArgs()


# ---- create_engine_config ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(quantization="modelopt"),
            "not supported yet: --quantization modelopt (drop --quantization; the closest that run are "
            "--quantization fp8 or bitsandbytes (quantized while loading), or an int4 GPTQ, AWQ, "
            "compressed-tensors or AutoRound checkpoint of the model)",
        ),
        (
            dict(distributed_executor_backend="external_launcher"),
            "not supported yet: --distributed-executor-backend external_launcher (drop it or set "
            "--distributed-executor-backend mp (processes of this host) or ray (Ray actors, on several "
            "machines too))",
        ),
        (
            dict(
                pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}
            ),
            "not supported yet: --pipeline-parallel-size 2 with --speculative-config",
        ),
        (dict(task="embed"), "not supported yet: --task embed (fitserve serves text generation"),
        (dict(compilation_config='{"level": 3}'), "not supported yet: --compilation-config key(s) level"),
    ],
)
def test_unsupported_features_are_refused(tiny_model: str, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        create_engine_config(EngineArgs(model=tiny_model, **kwargs))


@pytest.mark.parametrize("kwargs", [dict(enable_chunked_prefill=False), dict(task="generate")])
def test_vllm_flags_that_change_no_result_are_accepted(
    tiny_model: str, kwargs: dict, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="fitserve"):
        config = create_engine_config(EngineArgs(model=tiny_model, **kwargs))
    assert config is not None
    if "enable_chunked_prefill" in kwargs:
        assert "chunked prefill stays on" in caplog.text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_num_seqs=0), "max_num_seqs=0 is below the minimum 1: set --max-num-seqs to 1 or more"),
        (dict(max_logprobs=-2), "max_logprobs=-2 is below the minimum -1: set --max-logprobs to -1 or more"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization=1.5 is outside (0, 1]"),
        (
            dict(max_num_seqs=64, max_num_batched_tokens=32),
            "max_num_batched_tokens=32 is below max_num_seqs=64",
        ),
        (dict(cpu_kv_cache_space=0), "cpu_kv_cache_space=0 GiB is not above 0"),
        (
            dict(long_prefill_token_threshold=-1),
            "long_prefill_token_threshold=-1 is below the minimum 0: set --long-prefill-token-threshold to 0 "
            "or more",
        ),
        (
            dict(compilation_config='{"cudagraph_capture_sizes": [0, 1]}'),
            "cudagraph_capture_sizes=[0, 1] holds 0, below the minimum 1",
        ),
    ],
)
def test_values_out_of_range_are_refused(tiny_model: str, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        create_engine_config(EngineArgs(model=tiny_model, **kwargs))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(dtype="int8"), "dtype='int8' is not one of auto, half, float16, bfloat16, float, float32"),
        (dict(load_format="pt"), "load_format='pt' is not one of auto, safetensors, gguf, dummy"),
        (dict(block_size=24), "block_size=24 is not one of 1, 8, 16, 32, 64, 128: set --block-size"),
        (dict(device="tpu"), "device='tpu' is not one of auto, cuda, cpu: set --device to one of them"),
    ],
)
def test_choices_are_checked_for_python_callers(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        create_engine_config(EngineArgs(**kwargs))


def test_unsupported_quantized_checkpoint_is_refused(tiny_model: str, tmp_path: Path) -> None:
    """fitserve runs 4-bit AWQ / GPTQ / compressed-tensors / AutoRound checkpoints
    (tests/unit/test_quant_int4_*.py); other bit widths are refused before loading."""
    quantized = tmp_path / "quantized"
    shutil.copytree(tiny_model, quantized)
    config = json.loads((quantized / "config.json").read_text(encoding="utf-8"))
    config["quantization_config"] = {"quant_method": "awq", "bits": 3}
    (quantized / "config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ValueError, match=r"^AWQ bits=3: fitserve runs 4-bit AWQ checkpoints only"):
        create_engine_config(EngineArgs(model=str(quantized)))


def test_cuda_device_without_a_gpu_is_refused(tiny_model: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="device=cuda but torch sees no CUDA GPU: set --device cpu"):
        create_engine_config(EngineArgs(model=tiny_model, device="cuda"))


def test_max_model_len_above_the_models_own_is_refused(tiny_model: str) -> None:
    with pytest.raises(ValueError) as error:
        create_engine_config(EngineArgs(model=tiny_model, max_model_len=TINY_MAX_POSITIONS * 2))
    message = str(error.value)
    assert (
        f"max_model_len={TINY_MAX_POSITIONS * 2} is above the model's own limit {TINY_MAX_POSITIONS}"
        in message
    )
    assert f"set --max-model-len {TINY_MAX_POSITIONS} or less" in message


def test_resolved_config_on_cpu(tiny_model: str) -> None:
    args = EngineArgs(
        model=tiny_model,
        device="cpu",
        block_size=32,
        served_model_name="tiny",
        compilation_config='{"cudagraph_capture_sizes": [8, 1, 2, 2]}',
        cpu_kv_cache_space=1.5,
        seed=7,
    )
    config = create_engine_config(args)
    assert config.device.device == "cpu"
    assert config.model.dtype == torch.float32  # auto on CPU, whatever the checkpoint's dtype
    assert config.model.max_model_len == config.scheduler.max_model_len == TINY_MAX_POSITIONS
    assert config.model.hf_config.num_hidden_layers == 2
    assert config.model.served_model_name == ("tiny",)
    assert config.model.name_for_api == "tiny"
    assert config.model.seed == 7
    assert config.scheduler.max_num_batched_tokens == 2048
    assert config.scheduler.max_num_seqs == 256
    assert config.cache.block_size == 32
    assert config.cache.cpu_kv_cache_space_gib == 1.5
    assert config.compilation.cudagraph_capture_sizes == ()  # the CPU captures no graphs
    assert config.quantization is None


def test_explicit_values_are_kept(tiny_model: str) -> None:
    config = create_engine_config(
        EngineArgs(
            model=tiny_model, device="cpu", dtype="bfloat16", max_model_len=100, max_num_batched_tokens=300
        )
    )
    assert config.model.dtype == torch.bfloat16
    assert config.scheduler.max_model_len == 100
    assert config.scheduler.max_num_batched_tokens == 300
    assert config.model.served_model_name == ()


def test_default_token_budget_covers_max_num_seqs(tiny_model: str) -> None:
    config = create_engine_config(EngineArgs(model=tiny_model, device="cpu", max_num_seqs=4096))
    assert config.scheduler.max_num_batched_tokens == 4096


# ---- dtype rule (the planner's, planner/fit.py: one rule for every entry point) -------------------------


def _resolved_dtype(model_dtype: str | None, device: str, requested: str = "auto") -> str:
    """The dtype auto-fit resolves for the Qwen3-0.6B shape stored in `model_dtype`, on `device`
    ("cpu" or an --assume-gpus spec such as "1x80@9.0")."""
    config = AutoConfig.from_pretrained(fixture_path("qwen3-0.6b"))
    config.dtype = model_dtype
    info = ModelInfo.from_hf_config("qwen3-0.6b", "test", config)
    if device == "cpu":
        devices = (DeviceSpec("cpu", 0, "CPU", 64 * 2**30, 64 * 2**30),)
    else:
        devices = parse_assume_gpus(device)
    (dtype,) = [
        c.value for c in auto_fit(info, EngineArgs(dtype=requested), devices).choices if c.setting == "dtype"
    ]
    return dtype


@pytest.mark.parametrize(
    ("model_dtype", "capability", "expected"),
    [
        ("bfloat16", "9.0", "bfloat16"),
        ("float16", "9.0", "float16"),
        ("float32", "8.0", "bfloat16"),
        (None, "8.6", "bfloat16"),
        ("bfloat16", "7.5", "float16"),
        ("float32", "7.0", "float16"),
    ],
)
def test_auto_dtype_on_cuda(model_dtype: str | None, capability: str, expected: str) -> None:
    assert _resolved_dtype(model_dtype, f"1x80@{capability}") == expected


def test_bfloat16_refused_below_compute_capability_8() -> None:
    with pytest.raises(ValueError, match=r"needs compute capability 8.0, .* has 7.5: set --dtype half"):
        _resolved_dtype("bfloat16", "1x16@7.5", requested="bfloat16")


def test_dtype_names() -> None:
    assert _resolved_dtype(None, "cpu", requested="half") == "float16"
    assert _resolved_dtype(None, "cpu", requested="float") == "float32"
    assert _resolved_dtype("bfloat16", "cpu") == "float32"
