"""Gemma-4's Triton paths on CUDA (gemma4_layers.py's kernels: Gemma RMSNorm, norm + residual add,
gelu-and-mul, the fused q/k norm + RoPE + cache write, q alone on KV-shared layers) against its torch paths
on the same GPU (gemma4_layers.USE_KERNELS off), and a CUDA graph of a cut model's decode step replayed
equal to eager (run on the GPU machine).

Real geometries from shared/models cut to a few layers, bf16, random weights: 31B (dense; head dims 256
and 512, K=V full layers, 32 / 16 / 4 heads), 26B-A4B (the MoE block beside the dense MLP) and E2B
(per-layer inputs, KV-shared layers that normalise and rotate q alone, double-wide MLPs).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from fitserve.kv_layers import kv_layer_specs  # noqa: E402
from fitserve.layers.attention.metadata import AttentionMetadata, forward_context  # noqa: E402
from fitserve.models import gemma4_layers  # noqa: E402
from fitserve.models.checkpoint_config import CheckpointConfig  # noqa: E402
from fitserve.models.loader import default_dtype  # noqa: E402
from fitserve.models.registry import get_model_class  # noqa: E402
from tests.paths import MODELS_DIR  # noqa: E402
from tests.unit.model_helpers import ChunkSpec, build_attention_metadata  # noqa: E402

S, F = "sliding_attention", "full_attention"
# (shape, layer types, config changes): each layer type once (E2B: 2 layers of each, then 2 that read
# their caches)
CUTS = {
    "gemma-4-31b-it": ([S, F], {}),
    "gemma-4-26b-a4b-it": ([S, F], {}),
    "gemma-4-e2b-it": ([S, F, S, F], {"num_kv_shared_layers": 2}),
}
BLOCK_SIZE, BLOCKS_PER_SEQUENCE = 16, 8
# ||kernels - torch|| / ||torch|| over a step's hidden states: the kernels round less often than torch's
# ops (float32 inside a fused kernel), a few bfloat16 ulps through two to four layers; a wrong rotation,
# norm or add is O(1)
PATH_TOLERANCE = 3e-2


def _build(shape: str, tmp_path: Path):
    """fitserve's model of the cut geometry on CUDA in bfloat16, with O(1)-scale random weights."""
    layer_types, changes = CUTS[shape]
    raw = json.loads((MODELS_DIR / shape / "config.json").read_text())
    raw["text_config"].update(num_hidden_layers=len(layer_types), layer_types=layer_types, **changes)
    folder = tmp_path / shape
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    config = CheckpointConfig.from_folder(folder)
    assert config is not None
    torch.manual_seed(0)
    with default_dtype(torch.bfloat16), torch.device("cuda"):
        model = get_model_class(config)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layer_scalar"):
                param.copy_(0.5 + torch.rand_like(param))
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                # scores of O(1): with the scale 1.0 of Gemma-4, unit q and k heads of 256 or 512 dims
                # would give logits of std 16-23 and a softmax that magnifies every rounding
                param.copy_(0.3 * (1.0 + 0.2 * torch.randn_like(param)))
            elif "norm" in name or name.endswith(("scale", "per_expert_scale")):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif "embed" in name:
                param.copy_(torch.randn_like(param))
            elif param.dim() >= 2:
                param.copy_(torch.randn_like(param) / math.sqrt(param.shape[-1]))
    return config, model


def _on_cuda(metadata: AttentionMetadata) -> AttentionMetadata:
    return dataclasses.replace(
        metadata,
        slot_mapping=metadata.slot_mapping.cuda(),
        query_start_loc=metadata.query_start_loc.cuda(),
        seq_lens=metadata.seq_lens.cuda(),
        block_tables=metadata.block_tables.cuda(),
    )


class _Runner:
    """Steps of a few sequences over per-layer paged caches; each sequence holds BLOCKS_PER_SEQUENCE
    shuffled blocks from the start (fixed block tables, as a captured graph needs)."""

    def __init__(self, model, config, num_sequences: int) -> None:
        self.model = model
        num_blocks = num_sequences * BLOCKS_PER_SEQUENCE + 1
        self.kv_caches = [
            torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
            if spec.owns_cache(index)
            else torch.empty(0, device="cuda")
            for index, spec in enumerate(kv_layer_specs(config))
            for shape in [(2, num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)]
        ]
        blocks = list(range(1, num_blocks))
        random.Random(1).shuffle(blocks)
        self.blocks = [
            blocks[i * BLOCKS_PER_SEQUENCE : (i + 1) * BLOCKS_PER_SEQUENCE] for i in range(num_sequences)
        ]
        self.lengths = [0] * num_sequences

    def inputs(self, new_tokens: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's (input_ids, positions, metadata) for new_tokens[i] after sequence i's cached ones;
        advances the lengths."""
        specs, positions = [], []
        for index, tokens in enumerate(new_tokens):
            specs.append(ChunkSpec(self.lengths[index], len(tokens), self.blocks[index]))
            positions.extend(range(self.lengths[index], self.lengths[index] + len(tokens)))
            self.lengths[index] += len(tokens)
        ids = torch.tensor([t for tokens in new_tokens for t in tokens], device="cuda")
        return (
            ids,
            torch.tensor(positions, device="cuda"),
            _on_cuda(build_attention_metadata(specs, BLOCK_SIZE)),
        )

    @torch.no_grad()
    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        with forward_context(metadata, self.kv_caches):
            return self.model(ids, positions)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _tokens(count: int, seed: int) -> list[int]:
    generator = random.Random(seed)
    return [generator.randrange(1000, 200_000) for _ in range(count)]


@contextmanager
def torch_path() -> Iterator[None]:
    """The model's torch path on CUDA inside the block (the kernels' off switch)."""
    gemma4_layers.USE_KERNELS = False
    try:
        yield
    finally:
        gemma4_layers.USE_KERNELS = True


@pytest.mark.parametrize("shape", list(CUTS))
def test_kernel_paths_match_torch_paths(shape, tmp_path):
    """A prefill of three sequences then three decode steps, each run through the kernels and through
    torch from the same caches: the hidden states and the keys and values written agree."""
    config, model = _build(shape, tmp_path)
    prompts = [_tokens(n, seed) for seed, n in enumerate((37, 5, 64))]
    kernels, reference = _Runner(model, config, 3), _Runner(model, config, 3)
    steps = [prompts] + [[_tokens(1, 100 * step + i) for i in range(3)] for step in range(3)]
    for number, new_tokens in enumerate(steps):
        got = kernels.forward(*kernels.inputs(new_tokens))
        with torch_path():
            want = reference.forward(*reference.inputs(new_tokens))
        error = _relative(got, want)
        assert error <= PATH_TOLERANCE, f"step {number}: hidden states differ by {error:.4f}"
    for layer, (got, want) in enumerate(zip(kernels.kv_caches, reference.kv_caches)):
        if want.numel():
            error = _relative(got, want)
            assert error <= PATH_TOLERANCE, f"layer {layer}'s cache differs by {error:.4f}"


@pytest.mark.parametrize("shape", list(CUTS))
def test_cacheless_forward_matches_torch_path(shape, tmp_path):
    """The startup's profiling forward (no metadata, no cache): q and k are normalised and rotated
    before the attention (the KV-shared layers take them as tensors), on both paths."""
    config, model = _build(shape, tmp_path)
    ids = torch.tensor(_tokens(48, 7), device="cuda")
    positions = torch.arange(48, device="cuda")
    with torch.no_grad(), forward_context(None, []):
        got = model(ids, positions)
        with torch_path():
            want = model(ids, positions)
    assert _relative(got, want) <= PATH_TOLERANCE


@pytest.mark.parametrize("shape", list(CUTS))
def test_decode_step_replays_in_a_cuda_graph(shape, tmp_path):
    """The decode step's forward and softcapped logits captured once (capture itself fails on a host
    sync), then replayed for two steps with new tokens, positions and slots: each replay equals the
    eager step from the same caches, logits and the keys and values written alike."""
    config, model = _build(shape, tmp_path)
    num_sequences = 4
    runner = _Runner(model, config, num_sequences)
    runner.forward(*runner.inputs([_tokens(n, seed) for seed, n in enumerate((5, 17, 33, 9))]))
    torch.cuda.synchronize()
    ids, positions, metadata = runner.inputs([_tokens(1, 50 + i) for i in range(num_sequences)])
    # the host-side lengths are captured: set them as a graph runner does, to the longest context
    metadata = dataclasses.replace(metadata, max_seq_len=BLOCK_SIZE * BLOCKS_PER_SEQUENCE)
    before = [cache.clone() for cache in runner.kv_caches]

    def step() -> torch.Tensor:
        with torch.no_grad(), forward_context(metadata, runner.kv_caches):
            return model.compute_logits(model(ids, positions))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: compiles every kernel, as a graph runner does before capturing
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for cache, saved in zip(runner.kv_caches, before):
        cache.copy_(saved)

    replays: list[torch.Tensor] = []
    for number in range(2):
        if number:  # the next step's inputs, written into the captured tensors
            new_ids, new_positions, new_metadata = runner.inputs([_tokens(1, 60 + i) for i in range(4)])
            ids.copy_(new_ids)
            positions.copy_(new_positions)
            for field in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
                getattr(metadata, field).copy_(getattr(new_metadata, field))
        before = [cache.clone() for cache in runner.kv_caches]
        graph.replay()
        replayed = captured.clone()
        replayed_caches = [cache.clone() for cache in runner.kv_caches]
        for cache, saved in zip(runner.kv_caches, before):
            cache.copy_(saved)
        eager = step()
        assert _relative(replayed, eager) <= 1e-3, f"replay {number}: logits differ from the eager step"
        for layer, (got, want) in enumerate(zip(replayed_caches, runner.kv_caches)):
            if want.numel():
                assert _relative(got, want) <= 1e-3, f"replay {number}: layer {layer}'s cache differs"
        replays.append(replayed)
    assert not torch.equal(replays[0], replays[1]), "the second replay repeated the first step"
