"""The all-reduce alone at decode sizes across the GPUs of one machine: NCCL against torch's symmetric-
memory one-shot all-reduce (each rank reads every peer's buffer over NVLink and sums: one kernel, no
NCCL protocol) and fitserve's own (distributed/custom_all_reduce.py: each rank pushes its values to every
peer and sums what arrived), microseconds per call, each measured inside a CUDA graph of 64 calls (as a
decode step replays them) and eagerly.

  python benchmarks/gpu/tp_allreduce.py [--ranks 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import socket
import time

from common import save  # noqa: I001

SIZES_BYTES = [8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20, 2 << 20]
CALLS_PER_GRAPH = 64


def _time_us(fn, repeats: int = 20) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e6


def _graph_us(body) -> float:
    import torch

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            body()
    return _time_us(graph.replay) / CALLS_PER_GRAPH


def _rank(rank: int, size: int, port: int, results) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        device_id=torch.device("cuda", rank),
    )
    group_name = dist.group.WORLD.group_name
    from fitserve.distributed.custom_all_reduce import MAX_BYTES, CustomAllReduce

    custom = CustomAllReduce.create(dist.group.WORLD, rank, size, torch.device("cuda", rank), 600.0)
    rows = []
    for nbytes in SIZES_BYTES:
        numel = nbytes // 2
        x = torch.randn(numel, dtype=torch.bfloat16, device="cuda")
        buffer = symm_mem.empty(numel, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(buffer, group_name)
        out = torch.empty_like(x)
        gathered = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(gathered, x)
        expected = torch.stack(gathered).float().sum(0)

        def one_shot(x=x, buffer=buffer, out=out):
            buffer.copy_(x)
            torch.ops.symm_mem.one_shot_all_reduce_out(buffer, "sum", group_name, out)

        def nccl(x=x, out=out):
            out.copy_(x)
            dist.all_reduce(out)

        def fitserve_custom(x=x, out=out):
            out.copy_(x)
            custom(out)

        one_shot()
        torch.cuda.synchronize()
        one_shot_error = (out.float() - expected).abs().max().item()
        nccl()
        torch.cuda.synchronize()
        nccl_error = (out.float() - expected).abs().max().item()
        row = {
            "bytes": nbytes,
            "nccl_graph_us": round(_graph_us(nccl), 2),
            "one_shot_graph_us": round(_graph_us(one_shot), 2),
            "nccl_eager_us": round(_time_us(nccl), 2),
            "one_shot_eager_us": round(_time_us(one_shot), 2),
            "max_abs_error_nccl": nccl_error,
            "max_abs_error_one_shot": one_shot_error,
        }
        if custom is not None and nbytes <= MAX_BYTES:
            fitserve_custom()
            torch.cuda.synchronize()
            row["custom_exact"] = bool(torch.equal(out.float(), expected.to(out.dtype).float()))
            row["custom_graph_us"] = round(_graph_us(fitserve_custom), 2)
            row["custom_eager_us"] = round(_time_us(fitserve_custom), 2)
        rows.append(row)
    if rank == 0:
        results.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=_rank, args=(r, args.ranks, port, results)) for r in range(args.ranks)
    ]
    for process in processes:
        process.start()
    rows = results.get(timeout=600)
    for process in processes:
        process.join()
    save(
        f"tp{args.ranks}_allreduce",
        {"ranks": args.ranks, "calls_per_graph": CALLS_PER_GRAPH, "sizes": rows},
        args.out,
    )
    os._exit(0)


if __name__ == "__main__":
    main()
