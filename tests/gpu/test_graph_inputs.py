"""The one-launch copy of a decode step's inputs into the graph buffers against the torch copies."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from fitserve.kernels.graph_inputs import stage_decode_inputs  # noqa: E402
from fitserve.worker.cuda_graphs import CudaGraphRunner  # noqa: E402

pytestmark = pytest.mark.gpu


def _runner() -> CudaGraphRunner:
    runner = CudaGraphRunner(
        model=torch.nn.Identity(),
        kv_caches=[],
        capture_sizes=[1, 2, 4, 8, 16],
        max_blocks_per_seq=300,
        max_model_len=4800,
        hidden_size=8,
        dtype=torch.bfloat16,
        device=torch.device("cuda"),
    )
    generator = torch.Generator(device="cuda").manual_seed(0)
    for buffer in runner.static_inputs():
        buffer.copy_(torch.randint(0, 1000, buffer.shape, device="cuda", generator=generator))
    return runner


@pytest.mark.parametrize(("batch", "width", "num_fills"), [(1, 1, 0), (3, 9, 2), (13, 300, 13), (16, 140, 5)])
def test_matches_the_torch_copies(batch: int, width: int, num_fills: int) -> None:
    generator = torch.Generator(device="cuda").manual_seed(batch)
    ids = torch.randint(0, 50000, (batch,), device="cuda", generator=generator)
    fill_rows = torch.randperm(batch, device="cuda", generator=generator)[:num_fills]
    ids[fill_rows] = -1
    last_sampled = torch.randint(0, 50000, (20,), device="cuda", generator=generator)
    fill_sources = torch.randint(0, 20, (num_fills,), device="cuda", generator=generator)
    sources = (
        ids,
        torch.randint(0, 4000, (batch,), device="cuda", generator=generator),
        torch.randint(0, 10**6, (batch,), device="cuda", generator=generator),
        torch.randint(1, 4000, (batch,), device="cuda", generator=generator, dtype=torch.int32),
        torch.randint(0, 10**5, (batch, width), device="cuda", generator=generator, dtype=torch.int32),
    )
    fill = (fill_rows, fill_sources, last_sampled) if num_fills else None
    fused, reference = _runner(), _runner()
    size = fused.padded_size(batch)
    stage_decode_inputs(sources, fused.static_inputs(), size, fill)
    reference.copy_inputs_torch(sources, size, fill)
    for got, expected in zip(fused.static_inputs(), reference.static_inputs(), strict=True):
        assert torch.equal(got, expected)
    if num_fills:
        assert (fused.input_ids[:batch] >= 0).all()


def test_refuses_a_batch_larger_than_the_buffers() -> None:
    runner = _runner()
    sources = tuple(torch.zeros(17, dtype=torch.long, device="cuda") for _ in range(4)) + (
        torch.zeros((17, 4), dtype=torch.int32, device="cuda"),
    )
    with pytest.raises(ValueError, match=r"17 rows x 4 blocks padded to 17 does not fit .* 16 rows x 300"):
        stage_decode_inputs(sources, runner.static_inputs(), 17)


def test_refuses_block_tables_whose_rows_are_not_contiguous() -> None:
    runner = _runner()
    tables = torch.zeros((4, 2), dtype=torch.int32, device="cuda").t()  # [2, 4], column stride 2
    sources = tuple(torch.zeros(2, dtype=torch.long, device="cuda") for _ in range(4)) + (tables,)
    with pytest.raises(ValueError, match=r"got strides \(1, 2\).*\.contiguous\(\)"):
        stage_decode_inputs(sources, runner.static_inputs(), 2)
