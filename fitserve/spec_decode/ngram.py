"""Prompt lookup (n-gram) drafts: find the sequence's last n tokens earlier in the sequence and propose
what followed them there.

The longest n from `max_n` down to `min_n` wins, and among matches of that length the latest one (in a
rewrite or an edit the text just copied is the likeliest to go on). Vectorised with numpy: the
candidates are the positions holding the last token, then each further token back narrows them, so a
step costs a few array operations per request whatever the context length.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k draft tokens for the sequence `tokens` (int64, prompt + output), [] when nothing matches."""
    length = tokens.shape[0]
    if length < min_n + 1 or k < 1:
        return []
    # Candidate ends p (p < length - 1: a match must be followed by at least one token).
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    if ends.size == 0:
        return []
    matched = np.ones(ends.size, dtype=np.int64)  # every candidate matches the last token
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, max_n):
        if back >= length - 1:
            break
        earlier = ends - back
        ok = alive & (earlier >= 0)
        ok[ok] = tokens[earlier[ok]] == tokens[length - 1 - back]
        matched += ok
        alive = ok
        if not alive.any():
            break
    best = int(matched.max())
    if best < min_n:
        return []
    # the latest end among the longest matches
    end = int(ends[np.flatnonzero(matched == best)[-1]])
    return tokens[end + 1 : end + 1 + k].tolist()
