"""The `fitserve` command: subcommand parsing, the <think> split, and `generate` against transformers."""

from __future__ import annotations

import json
import runpy
import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from fitserve.cli.generate import format_answer
from fitserve.cli.main import main, parse_command
from fitserve.engine.reasoning_split import ReasoningSplit, prompt_ends_in_think, split_reasoning
from tests.model_folders import copy_smollm2_tokenizer
from tests.paths import FIXTURES_DIR, SMOLLM2_TOKENIZER_DIR

SMOLLM2_TOKENIZER = SMOLLM2_TOKENIZER_DIR
FIXTURE_32GB = str(FIXTURES_DIR / "seed-config-32gb.yaml")

# ---- the <think> split ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "prompt_opened_think", "expected"),
    [
        ("<think>\nadd 2 and 2\n</think>\n\n4", False, ReasoningSplit("\nadd 2 and 2\n", "\n\n4")),
        ("add 2 and 2\n</think>\n\n4", False, ReasoningSplit("add 2 and 2\n", "\n\n4")),
        ("add 2 and 2\n</think>\n\n4", True, ReasoningSplit("add 2 and 2\n", "\n\n4")),
        ("<think>still thinking", False, ReasoningSplit("still thinking", "")),
        ("still thinking", True, ReasoningSplit("still thinking", "")),
        ("plain answer", False, ReasoningSplit(None, "plain answer")),
        ("\n <think>r</think>done", False, ReasoningSplit("r", "done")),
        ("<think></think>4", False, ReasoningSplit("", "4")),
        ("a</think>b<think>c</think>d", False, ReasoningSplit("a", "b<think>c</think>d")),
        ("say <think> literally", False, ReasoningSplit(None, "say <think> literally")),
    ],
)
def test_split_reasoning(text: str, prompt_opened_think: bool, expected: ReasoningSplit) -> None:
    assert split_reasoning(text, prompt_opened_think) == expected


def test_prompt_ends_in_think() -> None:
    assert prompt_ends_in_think("<|Assistant|><think>\n")
    assert not prompt_ends_in_think("<|Assistant|><think>\n\n</think>\n\n")
    assert not prompt_ends_in_think("<|im_start|>assistant\n")


def test_format_answer_prints_think_and_answer_apart() -> None:
    assert format_answer("<think>\nadd 2 and 2\n</think>\n\n4", False) == "Think: add 2 and 2\nAnswer: 4"
    assert format_answer("add 2 and 2</think>4 ", True) == "Think: add 2 and 2\nAnswer: 4"
    assert format_answer(" 4\n", False) == "4"


# ---- parsing -------------------------------------------------------------------------------------------


def test_model_positional_wins_over_yaml_and_flag(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("model: from-yaml\nmax-num-seqs: 8\n", encoding="utf-8")
    command, _, namespace = parse_command(
        ["generate", "from-argv", "--config", str(config), "--prompt", "hi"]
    )
    assert command == "generate"
    assert namespace.model == "from-argv"
    assert namespace.max_num_seqs == 8
    _, _, namespace = parse_command(["generate", "--config", str(config), "--model", "from-flag"])
    assert namespace.model == "from-flag"
    _, _, namespace = parse_command(["generate", "--config", str(config)])
    assert namespace.model == "from-yaml"


def test_generate_flags(tmp_path: Path) -> None:
    _, _, namespace = parse_command(
        ["generate", "--prompt", "a", "--prompt", "b", "--no-chat", "--top-k", "5", "--temperature", "0"]
    )
    assert namespace.prompt == ["a", "b"]
    assert namespace.chat is False
    assert (namespace.top_k, namespace.temperature, namespace.top_p, namespace.max_tokens) == (
        5,
        0.0,
        None,
        256,
    )


def test_serve_parses_the_fixture_config() -> None:
    command, _, namespace = parse_command(["serve", "--config", FIXTURE_32GB, "--port", "7000"])
    assert command == "serve"
    assert namespace.port == 7000
    assert namespace.block_size == 32
    assert namespace.model == "/root/autodl-tmp/llms/deepseek-ai/DeepSeek-R1-Distill-Llama-70B"


def test_unknown_subcommand_and_missing_prompt_exit_2(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["gen"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'gen'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--max-tokens", "4"])
    assert exit_info.value.code == 2
    assert "no prompt given: add --prompt" in capsys.readouterr().err


def test_bench_is_listed_and_dispatched(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "bench" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "nonsense"])
    assert exit_info.value.code == 2
    assert "fitserve bench: error: argument BENCHMARK: invalid choice: 'nonsense'" in capsys.readouterr().err


def test_python_dash_m_fitserve_runs_the_cli(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(sys, "argv", ["fitserve", "generate", "--max-num-seq", "2"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("fitserve", run_name="__main__")
    assert exit_info.value.code == 2
    assert "--max-num-seq (did you mean --max-num-seqs?)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--quantization", "modelopt"],
            "not supported yet: --quantization modelopt (drop --quantization; the closest that run are",
        ),
        (["--top-p", "2"], "top_p=2.0 is outside the range (0, 1]"),
        (["--max-tokens", "0"], "max_tokens=0 is below the minimum 1"),
    ],
)
def test_refused_values_exit_with_the_message(
    capsys: pytest.CaptureFixture, flags: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "hi", *flags])
    assert exit_info.value.code == 2
    assert f"fitserve generate: error: {message}" in capsys.readouterr().err


# ---- generate, end to end against transformers -----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-chat-llama")
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_TOKENIZER)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        initializer_range=0.3,  # wide logits: varied text without near-ties (0.02 repeats one token)
    )
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(folder)
    return copy_smollm2_tokenizer(folder, chat_template=True)


def _transformers_greedy(model_dir: Path, prompt_ids: list[int], max_tokens: int) -> str:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
        )
    return tokenizer.decode(output[0, len(prompt_ids) :], skip_special_tokens=True).strip()


@pytest.mark.parametrize("chat", [False, True])
def test_generate_matches_transformers_greedy(
    tiny_chat_model: Path, capsys: pytest.CaptureFixture, chat: bool
) -> None:
    prompt, max_tokens = "The capital of France is", 12
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    if chat:
        messages = [{"role": "user", "content": prompt}]
        prompt_ids = list(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        )
    else:
        prompt_ids = tokenizer(prompt)["input_ids"]
    expected = _transformers_greedy(tiny_chat_model, prompt_ids, max_tokens)
    argv = ["generate", str(tiny_chat_model), "--prompt", prompt, "--temperature", "0", "--device", "cpu"]
    argv += ["--max-tokens", str(max_tokens), "--max-model-len", "256", "--cpu-kv-cache-space", "0.05"]
    if not chat:
        argv.append("--no-chat")
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert expected, "the reference produced no text; pick another seed"
    assert printed == expected + "\n"


def test_generate_auto_fits_max_model_len_to_a_small_kv_cache(
    tiny_chat_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    # The same model claiming a 4096-token context; 0.001 GiB of KV cache holds 2080 of its tokens.
    folder = tmp_path / "long-context"
    shutil.copytree(tiny_chat_model, folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (folder / "config.json").write_text(json.dumps(config))
    argv = ["generate", str(folder), "--prompt", "Hi", "--no-chat", "--device", "cpu"]
    argv += ["--max-tokens", "4", "--cpu-kv-cache-space", "0.001"]
    with caplog.at_level("INFO", logger="fitserve"):
        assert main(argv) == 0
    chosen = [r.getMessage() for r in caplog.records if r.getMessage().startswith("max_model_len = ")]
    assert chosen and "auto-fit" in chosen[0]
    assert 1024 <= int(chosen[0].split()[2]) < 4096
    assert capsys.readouterr().out.strip()


def test_generate_refuses_an_explicit_max_model_len_that_cannot_fit(
    tiny_chat_model: Path, capsys: pytest.CaptureFixture
) -> None:
    argv = ["generate", str(tiny_chat_model), "--prompt", "Hi", "--no-chat", "--device", "cpu"]
    argv += ["--max-model-len", "256", "--cpu-kv-cache-space", "0.0001"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "max_model_len" in error and "256" in error


def test_startup_log_says_each_thing_once(
    tiny_chat_model: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    """One "Model:" line (the plan and the engine both resolve the model), and an explicit setting's line
    says "set by you" once."""
    argv = ["generate", str(tiny_chat_model), "--prompt", "Hi", "--no-chat", "--device", "cpu"]
    argv += ["--max-tokens", "2", "--max-model-len", "256", "--cpu-kv-cache-space", "0.05"]
    with caplog.at_level("INFO", logger="fitserve"):
        assert main(argv) == 0
    messages = [record.getMessage() for record in caplog.records]
    assert len([m for m in messages if m.startswith("Model: ")]) == 1
    length_lines = [m for m in messages if m.startswith("max_model_len = 256")]
    assert length_lines == ["max_model_len = 256 (set by you)"]
    assert not [m for m in messages if "set by you: set by you" in m]
    assert capsys.readouterr().out.strip()
