"""One Gemma-4 decode step on CUDA through the torch path (gemma4_layers.USE_KERNELS off: ~5 kernels a
norm, RoPE in torch) and through the Triton kernels, eager, and the kernels' step replayed as a CUDA graph.

The real geometry from shared/models cut to --layers layers (the layer types in the checkpoint's order),
bf16, random weights, --batch sequences of --context tokens of KV each. Milliseconds per step for each path
and batch, and per layer, printed and saved as one JSON object (benchmarks/results/
h100_gemma4_kernel_paths.json, or --out).
  python benchmarks/gpu/gemma4_kernel_paths.py --model gemma-4-31b-it --layers 8 --batch 1 8 --context 512
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from common import MODELS, save  # noqa: I001

from fitserve.kv_layers import kv_layer_specs
from fitserve.layers.attention.metadata import AttentionMetadata, forward_context
from fitserve.models import gemma4_layers
from fitserve.models.checkpoint_config import CheckpointConfig
from fitserve.models.loader import default_dtype
from fitserve.models.registry import get_model_class

BLOCK_SIZE = 16


def build(model_name: str, layers: int, folder: Path):
    raw = json.loads((MODELS / model_name / "config.json").read_text())
    text = raw["text_config"]
    text.update(num_hidden_layers=layers, layer_types=text["layer_types"][:layers])
    text["num_kv_shared_layers"] = 0  # a cut keeps every layer's own cache
    (folder / "config.json").write_text(json.dumps(raw))
    config = CheckpointConfig.from_folder(folder)
    with default_dtype(torch.bfloat16), torch.device("cuda"):
        model = get_model_class(config)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(("scale", "scalar")):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    return config, model


def decode_inputs(
    config, batch: int, context: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list]:
    """Row i decodes position `context` over its own blocks (KV left as zeros: the time is the same)."""
    blocks = context // BLOCK_SIZE + 1
    tables = 1 + torch.arange(batch * blocks, dtype=torch.int32, device="cuda").view(batch, blocks)
    positions = torch.full((batch,), context, dtype=torch.int64, device="cuda")
    slots = tables[:, -1].long() * BLOCK_SIZE + context % BLOCK_SIZE
    metadata = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((batch,), context + 1, dtype=torch.int32, device="cuda"),
        block_tables=tables,
        max_query_len=1,
        max_seq_len=context + 1,
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=[context + 1] * batch,
    )
    caches = [
        torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
        for spec in kv_layer_specs(config)
        for shape in [(2, 1 + batch * blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)]
    ]
    ids = torch.randint(0, 10000, (batch,), device="cuda")
    return ids, positions, metadata, caches


def time_ms(run, repeats: int) -> float:
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    torch.cuda.synchronize()
    return round((time.perf_counter() - start) / repeats * 1e3, 3)


def measure(model, config, batch: int, context: int, layers: int, repeats: int) -> dict:
    ids, positions, metadata, caches = decode_inputs(config, batch, context)

    def step() -> torch.Tensor:
        with torch.no_grad(), forward_context(metadata, caches):
            return model(ids, positions)

    row: dict = {}
    gemma4_layers.USE_KERNELS = False
    row["torch_eager_ms"] = time_ms(step, repeats)
    gemma4_layers.USE_KERNELS = True
    row["kernels_eager_ms"] = time_ms(step, repeats)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
        row["kernels_graph_ms"] = time_ms(graph.replay, repeats)
    except RuntimeError as error:  # e.g. the MoE experts' host sync, until their kernel lands
        row["kernels_graph_error"] = str(error).splitlines()[0]
    per_layer = {
        f"{key}_per_layer": round(value / layers, 4) for key, value in row.items() if key.endswith("_ms")
    }
    return {**row, **per_layer}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gemma-4-31b-it")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        config, model = build(args.model, args.layers, Path(folder))
    figures = {"model": args.model, "layers": args.layers, "context": args.context}
    for batch in args.batch:
        figures[f"batch_{batch}"] = measure(model, config, batch, args.context, args.layers, args.repeats)
    save("gemma4_kernel_paths", figures, args.out)


if __name__ == "__main__":
    main()
