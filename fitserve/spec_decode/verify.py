"""A verify step, on the runner's side.

The scheduler gives a request with k drafts k + 1 new tokens: its last known token, then the drafts. The
model runner computes them as k + 1 rows of one token each, row j at position start + j, all reading the
request's one block table (each row's attention sees the positions up to its own, whose keys and values
the same step writes first): a verify step is shaped like a decode step of batch x (k + 1) rows, and
replays the decode CUDA graphs. Row j samples the token after draft j - 1 as the target would (its
penalties and min_tokens counting the drafts before it); the drafts are accepted while they equal those
samples, and the request gains the accepted drafts plus the sample at the first mismatch (or after the
last draft): 1 to k + 1 tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fitserve.core.scheduler import ScheduledRequest


def verify_rows(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """The step's rows: a request with drafts becomes k + 1 rows of one token (row j's draft_token_ids
    are the drafts before its position, its token the last of them); others stay as they are."""
    rows: list[ScheduledRequest] = []
    for item in scheduled:
        drafts = item.draft_token_ids
        if not drafts:
            rows.append(item)
            continue
        for j in range(len(drafts) + 1):
            rows.append(
                dataclasses.replace(item, start=item.start + j, num_new_tokens=1, draft_token_ids=drafts[:j])
            )
    return rows


def num_accepted(sampled: Sequence[int], drafts: Sequence[int]) -> int:
    """How many drafts the samples confirm: the drafts' longest prefix equal to the samples'."""
    count = 0
    for token, draft in zip(sampled, drafts):
        if token != draft:
            break
        count += 1
    return count
