"""Speculative decoding's counters, as vLLM exports them (`vllm:spec_decode_num_drafts`,
`..._num_draft_tokens`, `..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`), and the periodic
log line (mean acceptance length, per-position acceptance rates)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_speculative_tokens: int
    num_drafts: int = 0  # request-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_speculative_tokens

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """One request's verify: num_drafted drafts checked, the first num_accepted of them accepted."""
        if num_drafted <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_pos[position] += 1

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_speculative_tokens,
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_pos),
        )

    def log_line(self, since: SpecDecodeStats | None = None) -> str | None:
        """vLLM's "SpecDecoding metrics" line over the drafts since `since` (None: since the start), or
        None when nothing was drafted meanwhile."""
        base = since or SpecDecodeStats(self.num_speculative_tokens)
        drafts = self.num_drafts - base.num_drafts
        if drafts <= 0:
            return None
        drafted = self.num_draft_tokens - base.num_draft_tokens
        accepted = self.num_accepted_tokens - base.num_accepted_tokens
        per_pos = [(now - then) / drafts for now, then in zip(self.accepted_per_pos, base.accepted_per_pos)]
        rates = ", ".join(f"{rate:.3f}" for rate in per_pos)
        return (
            f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
            f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
            f"Per-position acceptance rate: {rates}, "
            f"Avg Draft acceptance rate: {100 * accepted / drafted:.1f}%"
        )
