"""Filling a batch's grammar bitmasks at once: xgrammar's BatchGrammarMatcher spreads the rows over its
threads (in C++, off the GIL's path), where a loop of GrammarMatcher.fill_next_token_bitmask fills them one
by one on the engine's thread. Measured on an H100 host (Llama-3.1-8B shape, 32 requests under a 10-field
JSON schema): the loop took 5.8 ms of host time per step, more than the step's forward, so the step waited
on it (benchmarks/results/h100_structured_profile.json). Lark grammars' states (llguidance, lark.py) in the
same batch fill their own rows one by one, beside the xgrammar rows."""

from __future__ import annotations

from typing import Any

import torch

from fitserve.structured.backend import GrammarState, _xgrammar

# Below this many rows the loop is cheaper than handing them to the thread pool.
MIN_BATCH_ROWS = 4

_batch_matcher: Any = None


def _batcher() -> Any:
    global _batch_matcher
    if _batch_matcher is None:
        _batch_matcher = _xgrammar().BatchGrammarMatcher(max_threads="auto")
    return _batch_matcher


def fill_bitmasks(states: list[Any], bitmask: torch.Tensor) -> None:
    """bitmask[j] <- the tokens states[j] allows next (a CPU int32 tensor [>= len(states), width]);
    states: GrammarState (xgrammar) or lark.LarkGrammarState, in any mix."""
    if not all(isinstance(state, GrammarState) for state in states):
        xgrammar_rows = []
        for row, state in enumerate(states):
            if isinstance(state, GrammarState):
                xgrammar_rows.append(row)
            else:
                state.fill_bitmask(bitmask, row)
        if len(xgrammar_rows) < MIN_BATCH_ROWS:
            for row in xgrammar_rows:
                states[row].fill_bitmask(bitmask, row)
        else:
            matchers = [states[row].matcher for row in xgrammar_rows]
            _batcher().batch_fill_next_token_bitmask(matchers, bitmask, indices=xgrammar_rows)
        return
    if len(states) < MIN_BATCH_ROWS:
        for row, state in enumerate(states):
            state.fill_bitmask(bitmask, row)
        return
    _batcher().batch_fill_next_token_bitmask([state.matcher for state in states], bitmask)
