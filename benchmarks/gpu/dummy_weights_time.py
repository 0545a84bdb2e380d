"""Time of --load-format dummy's weight draws on one GPU, as one rank of a tensor-parallel run.

Dummy weights draw each matrix whole and keep the rank's part (models/weights.py), so a rank of TP n
draws n times its own bytes (an expert-parallel rank only its own experts). For each case the model is
built on the GPU in bfloat16 as rank 0 of TP n (parallel_state set in this process, no group: nothing is
computed across ranks) with the shape's first `layers` decoder layers, and initialize_dummy_weights is
timed (after a warm-up call on the same model, best of 3). Figures: the rank's parameter GB, seconds, and
the whole bytes drawn per second; the peak memory the draws add over the parameters.
  python benchmarks/gpu/dummy_weights_time.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from common import MODELS, save  # noqa: I001

from fitserve.distributed.parallel_state import TensorParallel, set_tensor_parallel
from fitserve.models.checkpoint_config import CheckpointConfig
from fitserve.models.gemma4_config import with_expert_parallel
from fitserve.models.loader import default_dtype
from fitserve.models.registry import get_model_class
from fitserve.models.weights import initialize_dummy_weights

# (name, shape folder, decoder layers kept, TP size, expert parallel)
CASES = [
    ("llama-3.3-70b 8 layers, rank of TP 4", "llama-3.3-70b", 8, 4, False),
    ("llama-3.3-70b 8 layers, TP 1", "llama-3.3-70b", 8, 1, False),
    ("qwen3.6-27b 16 layers, rank of TP 4", "qwen3.6-27b", 16, 4, False),
    ("qwen3.6-35b-a3b 8 layers, rank of TP 4", "qwen3.6-35b-a3b", 8, 4, False),
    ("qwen3.6-35b-a3b 8 layers, rank of TP 4, expert parallel", "qwen3.6-35b-a3b", 8, 4, True),
    ("gemma-4-e4b whole, TP 1", "gemma-4-e4b-it", None, 1, False),
    ("gemma-4-26b-a4b 8 layers, rank of TP 2", "gemma-4-26b-a4b-it", 8, 2, False),
]


def config_folder(shape: str, layers: int | None) -> Path:
    config = json.loads((MODELS / shape / "config.json").read_text())
    text = config.get("text_config", config)
    if layers is not None:
        text["num_hidden_layers"] = layers
        if isinstance(text.get("layer_types"), list):
            text["layer_types"] = text["layer_types"][:layers]
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def time_case(shape: str, layers: int | None, size: int, expert_parallel: bool) -> dict:
    set_tensor_parallel(TensorParallel(0, size))
    try:
        config = with_expert_parallel(
            CheckpointConfig.from_folder(config_folder(shape, layers)), expert_parallel
        )
        with torch.device("cuda"), default_dtype(torch.bfloat16):
            model = get_model_class(config)(config)
        rank_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        initialize_dummy_weights(model, 0)  # warm-up: kernels, allocator
        torch.cuda.synchronize()
        times = []
        for _ in range(3):
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            started = time.perf_counter()
            initialize_dummy_weights(model, 0)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
            extra = torch.cuda.max_memory_allocated() - before
        del model
        torch.cuda.empty_cache()
    finally:
        set_tensor_parallel(TensorParallel())
    drawn = rank_bytes * (1 if expert_parallel else size)  # about: replicated tensors are drawn once
    return {
        "rank_param_gb": round(rank_bytes / 1e9, 2),
        "seconds": round(min(times), 3),
        "drawn_gb_per_s_about": round(drawn / 1e9 / min(times), 1),
        "peak_extra_gb": round(extra / 1e9, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    figures = {}
    for name, shape, layers, size, expert_parallel in CASES:
        figures[name] = time_case(shape, layers, size, expert_parallel)
        print(name, figures[name], flush=True)
    save("dummy_weights_time", figures, args.out)


if __name__ == "__main__":
    main()
