"""Quantized Gemma-4 under tensor parallel on the CPU (gloo, 2 processes; gemma4_quant_helpers' tiny
models): int4 checkpoints of the E model (per-layer inputs, KV-shared layers' q-only qkv, double-wide
MLPs), the dense model (K=V full layers, their 2 KV heads split) and the MoE (its experts 16-bit, split by
intermediate dim; full layers' single KV head replicated) give rank 0 the logits of one rank, over paged
caches of each rank's KV heads and without a cache. A TP size whose per-rank input of a row-parallel
layer is not whole groups is refused as the model is built, naming both numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fitserve.distributed.parallel_state import tp
from fitserve.layers.quantization.int4_method import Int4LinearMethod
from fitserve.models.checkpoint_config import CheckpointConfig
from fitserve.models.registry import get_model_class
from tests.quant_checkpoints import QuantSpec
from tests.unit.gemma4_helpers import GemmaRankRunner, random_tokens
from tests.unit.gemma4_quant_helpers import GROUP, build_model, int4_ignore, logits_of, write_int4
from tests.unit.quant_helpers import load_model
from tests.unit.tp_helpers import on_rank, run_ranks

# relative to the largest logit: a rank's int4 layers may run another CPU product than one rank's (the C
# kernel takes N a multiple of 16, else torch's or the dequantized weight), each rounding its own way (one
# rank's int4 logits already differ from the dequantized float32 reference by about 6e-4); a wrong rank
# slice would differ by O(1)
TOLERANCE = 2e-3
RUNS = {  # name -> (case, ConditionalGeneration form, format)
    "e-ct": ("e_model", True, "ct"),
    "dense-awq": ("dense", False, "awq"),
    "moe-ct": ("moe_k_eq_v", False, "ct"),
}


@torch.no_grad()
def rank_main(rank: int, folders: dict[str, str]) -> dict[str, Any]:
    """Each model's logits on this rank: a paged prefill of two prompts, then the no-cache forward (None
    off rank 0), and which of its layers are int4."""
    del rank  # the process's (parallel_state.tp())
    results = {}
    for name, folder in folders.items():
        model = load_model(Path(folder))
        runner = GemmaRankRunner(model, model.config)
        paged = runner.step([("a", random_tokens(13, seed=1)), ("b", random_tokens(9, seed=2))])
        results[name] = {
            "paged": paged,
            "no_cache": logits_of(model),
            "int4": sum(
                isinstance(m.linear_method, Int4LinearMethod)
                for m in model.modules()
                if hasattr(m, "linear_method")
            ),
        }
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, dict[str, Any]]:
    """name -> result at TP 1 (this process) and on each rank of TP 2."""
    root = tmp_path_factory.mktemp("gemma4_quant_tp")
    folders = {}
    for name, (case, conditional, fmt) in RUNS.items():
        spec = QuantSpec(fmt, GROUP, sym=fmt == "ct", ignore=int4_ignore(fmt))
        folders[name] = str(write_int4(root / name, build_model(case, conditional, seed=11), spec).folder)
    assert tp().size == 1
    single = rank_main(0, folders)
    first, second = run_ranks(rank_main, 2, folders)
    return {1: single, 2: first, 3: second}


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    error = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
    assert error < TOLERANCE, f"logits differ by {error:.3g} (relative) >= {TOLERANCE}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("name", list(RUNS))
def test_tp2_int4_equals_tp1(results, name):
    single, first, second = results[1][name], results[2][name], results[3][name]
    assert first["int4"] == single["int4"] > 0  # the same layers are int4 on every rank
    for got, want in zip(first["paged"], single["paged"], strict=True):
        assert_close(got, want)
    assert_close(first["no_cache"], single["no_cache"])
    assert second["paged"] is None and second["no_cache"] is None


def test_a_rank_input_off_a_group_is_refused(tmp_path):
    """An MLP of 32: at TP 2 a rank's down_proj holds 16 input columns, not a whole group of 32: refused
    as the model is built, naming the layer, both numbers and the fix (TP 1 builds)."""
    model_hf = build_model("dense", conditional=False, seed=12, intermediate_size=32)
    folder = write_int4(tmp_path, model_hf, QuantSpec("awq", GROUP, ignore=int4_ignore("awq"))).folder
    config = CheckpointConfig.from_folder(folder)
    get_model_class(config)(config)
    with on_rank(0, 2), pytest.raises(ValueError) as error:
        get_model_class(config)(config)
    message = str(error.value)
    assert "model.layers.0.mlp.down_proj" in message
    assert "each rank holds 16 input columns (32 / tensor_parallel_size 2)" in message
    assert "not a multiple of the 32 columns of a group (group_size 32)" in message
    assert "smaller --tensor-parallel-size" in message
