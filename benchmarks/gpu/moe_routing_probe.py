"""How an engine's dummy MoE model routes decode tokens, fitserve's or vLLM's: with dummy weights the routing
is whatever the random weights make it, and an engine whose tokens all went to a few experts would read a
fraction of the weights a real model reads. For 256 requests of 512 random prompt tokens decoding (eager
mode, so the hooks run), per decode step and MoE layer: the most (token, slot) pairs one expert gets and the
experts touched, averaged over the first 5 steps, steps 40-50 and the last 5.

fitserve: Qwen3MoeSparseBlock.route wrapped; vLLM: a forward hook on the router (a ReplicatedLinear with one
output an expert), the top k of its logits.

  python benchmarks/gpu/moe_routing_probe.py --engine fitserve|vllm [--model qwen3-30b-a3b-fp8] [--steps 100]
vLLM 0.26.0 from ../shared/vllm_bundle, with VLLM_DEEP_GEMM_WARMUP=skip (its warmup outlasts a device call).
"""

from __future__ import annotations

import argparse
import json
import os
import random

import torch
from common import REPO, TOKENIZER, engine_classes, engine_generate, save  # noqa: I001

BATCH, PROMPT_TOKENS = 256, 512


class RoutingLog:
    """(most pairs one expert gets, experts touched) of every routing of a full decode batch."""

    def __init__(self, num_experts: int, top_k: int) -> None:
        self.num_experts, self.top_k = num_experts, top_k
        self.calls: list[tuple[int, int]] = []

    def record(self, ids: torch.Tensor) -> None:
        if ids.shape[0] != BATCH:  # prefill chunks and mixed steps are not decode steps
            return
        counts = torch.bincount(ids.reshape(-1), minlength=self.num_experts)
        self.calls.append((int(counts.max()), int((counts > 0).sum())))

    def summary(self, layers: int) -> dict:
        steps = [self.calls[i : i + layers] for i in range(0, len(self.calls), layers)]

        def mean(group: list[list[tuple[int, int]]]) -> dict:
            flat = [call for step in group for call in step]
            count = max(1, len(flat))
            return {
                "steps": len(group),
                "max_pairs_one_expert": round(sum(most for most, _ in flat) / count, 1),
                "experts_touched": round(sum(touched for _, touched in flat) / count, 1),
            }

        return {
            "decode_steps_seen": len(steps),
            "mean_pairs_an_expert": BATCH * self.top_k / self.num_experts,
            "first_5": mean(steps[:5]),
            "steps_40_50": mean(steps[40:50]),
            "last_5": mean(steps[-5:]),
        }


def hook_fitserve(log: RoutingLog) -> None:
    from fitserve.models import qwen3_moe

    route = qwen3_moe.Qwen3MoeSparseBlock.route

    def logged_route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = route(self, x)
        log.record(ids)
        return weights, ids

    qwen3_moe.Qwen3MoeSparseBlock.route = logged_route


def hook_vllm(log: RoutingLog) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model in this process, where the hook is

    def router_hook(module: torch.nn.Module, inputs, output) -> None:
        router = type(module).__name__ == "ReplicatedLinear"
        if router and getattr(module, "output_size", 0) == log.num_experts:
            logits = output[0] if isinstance(output, tuple) else output
            log.record(torch.topk(logits.float(), log.top_k, dim=-1).indices)

    torch.nn.modules.module.register_module_forward_hook(router_hook)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["fitserve", "vllm"], required=True)
    parser.add_argument("--model", default="qwen3-30b-a3b-fp8", help="a folder of examples/models")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out")
    args = parser.parse_args()
    folder = REPO / "examples" / "models" / args.model
    config = json.loads((folder / "config.json").read_text())
    log = RoutingLog(int(config["num_experts"]), int(config["num_experts_per_tok"]))
    (hook_fitserve if args.engine == "fitserve" else hook_vllm)(log)
    LLM, SamplingParams = engine_classes(args.engine)
    llm = LLM(
        str(folder),
        tokenizer=str(TOKENIZER),
        load_format="dummy",
        max_model_len=1024,
        gpu_memory_utilization=0.9,
        enforce_eager=True,
    )
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(PROMPT_TOKENS)] for _ in range(BATCH)]
    engine_generate(llm, SamplingParams, prompts, args.steps)
    figures = {"engine": args.engine, "model": args.model} | log.summary(int(config["num_hidden_layers"]))
    print(json.dumps(figures), flush=True)
    save("moe_routing_probe", figures, args.out)


if __name__ == "__main__":
    main()
