"""The plan counts sliding-window layers by their window (fitserve/kv_groups.py): Gemma-4 26B-A4B at
max_model_len 131072 on an A100 80GB (79.19 GiB, SM 8.0) at gpu_memory_utilization 0.9, as issue 29's
field report serves it. By hand (../shared/models/gemma-4-26b-a4b-it/config.json):

- 30 layers: 25 sliding (window 1024, 8 KV heads x 256), 5 full (attention_k_eq_v: 2 KV heads x 512).
  Per token, K and V in bf16: sliding 25 x 2 x 8 x 256 = 102,400 elements, full 5 x 2 x 2 x 512 = 10,240.
- Blocks of 16; a 131,072-token request holds 8,192 blocks in the full group. `fitserve plan` steps at most
  1,024 tokens (serving's default), so a sliding layer holds cdiv(1023 + 1024, 16) + 1 = 129 blocks.
- One "request block" (1/8,192 of a full-length request) costs (8,192 x 10,240 + 129 x 102,400) / 8,192 =
  11,852.5 -> 11,853 elements per token, x 2 bytes = 23,706 bytes (23.15 KiB; 220 KiB counting every
  layer's whole context, the plan before this change, which held 114,512 tokens: 0.87 of one request).
- The KV budget B: N = B // (23,706 x 16) request blocks; tokens = (N - 1) x 16, max concurrency
  (N - 1) / 8,192; the sliding pool 1 + cdiv((N - 1) x 129, 8,192) blocks.
"""

from __future__ import annotations

import json

from fitserve.cli.plan import run_plan
from tests.paths import MODELS_DIR
from tests.unit.test_planner_cli import parse

MODEL = MODELS_DIR / "gemma-4-26b-a4b-it"
FLAGS = ["--assume-gpus", "1x79.19@8.0", "--max-model-len", "131072", "--gpu-memory-utilization", "0.9"]
GiB = 1 << 30


def plan_json(capsys, *extra: str) -> dict:
    assert run_plan(parse("plan", [str(MODEL), *FLAGS, *extra, "--json"])) == 0
    return json.loads(capsys.readouterr().out)


def test_26b_a4b_at_131072_counts_the_sliding_layers_by_their_window(capsys):
    plan = plan_json(capsys)
    assert plan["kv_bytes_per_token"] == 2 * (102_400 + 10_240)  # every layer, whole context
    assert plan["kv_bytes_per_request_token"] == 23_706
    full, sliding = plan["kv_groups"]
    assert (full["sliding_window"], len(full["layers"]), full["blocks_per_request"]) == (None, 5, 8_192)
    assert (sliding["sliding_window"], len(sliding["layers"])) == (1024, 25)
    assert sliding["blocks_per_request"] == 129
    n = plan["num_kv_blocks"]
    kv_bytes = plan["kv_cache_gib_per_gpu"] * GiB
    assert n == int(kv_bytes // (23_706 * 16)) or abs(n * 23_706 * 16 - kv_bytes) < 0.001 * GiB
    assert full["num_blocks"] == n
    assert sliding["num_blocks"] == 1 + -(-(n - 1) * 129 // 8_192)
    assert plan["kv_cache_tokens"] == (n - 1) * 16
    assert plan["max_concurrency"] == round((n - 1) / 8_192, 2)
    # the pools' own bytes: a full block is 16 x 10,240 x 2 bytes, a sliding one 16 x 102,400 x 2
    pools = full["num_blocks"] * 327_680 + sliding["num_blocks"] * 3_276_800
    assert abs(pools - kv_bytes) < 2 * 3_276_800 + 0.001 * GiB
    # 22.35 GiB of KV: about a million tokens, 7.7 full-length requests (was 114,512 tokens, 0.87)
    assert plan["kv_cache_tokens"] > 1_000_000 and plan["max_concurrency"] > 7.5


def test_a_longer_step_makes_the_sliding_group_keep_more(capsys):
    """8,192-token steps (LLM()'s default): cdiv(1023 + 8192, 16) + 1 = 576 + 1 = 577 sliding blocks a
    request, (8,192 x 10,240 + 577 x 102,400) / 8,192 = 17,452.5 -> 17,453 elements = 34,906 bytes per
    request token."""
    plan = plan_json(capsys, "--max-num-batched-tokens", "8192")
    assert [g["blocks_per_request"] for g in plan["kv_groups"]] == [8_192, 577]
    assert plan["kv_bytes_per_request_token"] == 34_906


def test_the_report_shows_each_group(capsys):
    assert run_plan(parse("plan", [str(MODEL), *FLAGS])) == 0
    text = capsys.readouterr().out
    assert "23.1504 KiB per token of a 131,072-token request" in text
    assert "full attention: 5 layers, 8,192 blocks a request at most" in text
    assert "sliding window 1,024: 25 layers, 129 blocks a request at most" in text


def test_gemma4_plans_cuda_graphs_unless_eager(capsys):
    """Gemma-4's decode steps run in CUDA graphs (the fused MoE, the windowed attention and the sliding
    group's tables staged beside the main ones): the plan reserves graph memory for them, as for a Llama;
    --enforce-eager (the seed command's flag) reserves none and says so."""
    gemma = plan_json(capsys)
    assert gemma["cuda_graph_gib"] > 0 and gemma["settings"]["cudagraph_capture_sizes"]
    eager = plan_json(capsys, "--enforce-eager")
    assert eager["cuda_graph_gib"] == 0 and eager["settings"]["cudagraph_capture_sizes"] == []
    choice = next(c for c in eager["choices"] if c["setting"] == "cudagraph_capture_sizes")
    assert "--enforce-eager" in choice["reason"]


def test_plan_counts_a_draft_model_beside_the_sliding_group(capsys):
    """The draft's KV lives in the full group's blocks (as many as the plan's request blocks): the plan
    takes it past the window as within it, and counts it per token."""
    draft = {
        "method": "draft_model",
        "model": str(MODELS_DIR / "gemma-4-e2b-it"),
        "num_speculative_tokens": 3,
    }
    plain = plan_json(capsys)
    plan = plan_json(capsys, "--speculative-config", json.dumps(draft))
    assert [group["sliding_window"] for group in plan["kv_groups"]] == [None, 1024]
    assert plan["kv_bytes_per_request_token"] > plain["kv_bytes_per_request_token"]
