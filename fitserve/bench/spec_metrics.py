"""Speculative decoding's counters around a `bench serve` run, read from the server's /metrics (vLLM's
`vllm:spec_decode_*` counters) before and after: the run's acceptance rate and length, per position."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Any

import httpx

PREFIX = "vllm:spec_decode_"
_LINE = re.compile(r"^(vllm:spec_decode_\w+?)(?:_total)?(?:\{([^}]*)\})?\s+([0-9.eE+-]+)$")
_POSITION = re.compile(r'position="(\d+)"')


@dataclass
class SpecCounters:
    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_pos: dict[int, float] = field(default_factory=dict)


def parse_spec_counters(text: str) -> SpecCounters | None:
    """The counters in a Prometheus text page (summed over engines), or None when it has none."""
    counters = SpecCounters()
    found = False
    for line in text.splitlines():
        match = _LINE.match(line.strip())
        if match is None:
            continue
        name, labels, value = match.group(1)[len(PREFIX) :], match.group(2) or "", float(match.group(3))
        found = True
        if name == "num_accepted_tokens_per_pos":
            position = _POSITION.search(labels)
            if position is not None:
                index = int(position.group(1))
                counters.accepted_per_pos[index] = counters.accepted_per_pos.get(index, 0.0) + value
        elif name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            setattr(counters, name, getattr(counters, name) + value)
    return counters if found else None


async def read_spec_counters(
    client: httpx.AsyncClient, base_url: str, headers: dict[str, str]
) -> SpecCounters | None:
    """The server's counters now; None when it has no /metrics or no speculative decoding."""
    with contextlib.suppress(httpx.HTTPError):
        response = await client.get(f"{base_url}/metrics", headers=headers, timeout=10.0)
        if response.status_code == 200:
            return parse_spec_counters(response.text)
    return None


def spec_decode_summary(before: SpecCounters | None, after: SpecCounters | None) -> dict[str, Any]:
    """The run's figures (keys as `vllm bench serve` writes them), {} without counters or drafts."""
    if before is None or after is None:
        return {}
    drafts = after.num_drafts - before.num_drafts
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    if drafts <= 0 or drafted <= 0:
        return {}
    positions = sorted(after.accepted_per_pos)
    per_pos = [(after.accepted_per_pos[p] - before.accepted_per_pos.get(p, 0.0)) / drafts for p in positions]
    return {
        "spec_decode_acceptance_rate": 100.0 * accepted / drafted,
        "spec_decode_acceptance_length": 1.0 + accepted / drafts,
        "spec_decode_num_drafts": int(drafts),
        "spec_decode_draft_tokens": int(drafted),
        "spec_decode_accepted_tokens": int(accepted),
        "spec_decode_per_position_acceptance_rates": per_pos,
    }


def format_spec_decode(summary: dict[str, Any], width: int) -> str:
    """The table's speculative decoding section."""
    lines = [f"{' Speculative Decoding ':-^{width}}"]
    lines.append(f"{'Acceptance rate (%):':<40} {summary['spec_decode_acceptance_rate']:<10.2f}")
    lines.append(f"{'Acceptance length:':<40} {summary['spec_decode_acceptance_length']:<10.2f}")
    lines.append(f"{'Drafts:':<40} {summary['spec_decode_num_drafts']:<10}")
    lines.append(f"{'Draft tokens:':<40} {summary['spec_decode_draft_tokens']:<10}")
    lines.append(f"{'Accepted tokens:':<40} {summary['spec_decode_accepted_tokens']:<10}")
    rates = ", ".join(f"{100 * rate:.1f}" for rate in summary["spec_decode_per_position_acceptance_rates"])
    lines.append(f"{'Per-position acceptance (%):':<40} {rates}")
    return "\n".join(lines)
