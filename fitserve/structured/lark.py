"""Lark grammars, through llguidance (its Lark front end): a request's Lark grammar checked without the
tokenizer, compiled against it off the step path, and a state per sequence with GrammarState's interface
(fill_bitmask, accept, valid_prefix_len, after, is_terminated), so the sampler, the manager, speculative
decoding and n > 1 take it unchanged.

xgrammar stays the backend for everything else: it fills a mask ~10x faster (backend.py's docstring);
llguidance is imported only when the first Lark grammar arrives. Which grammar is Lark is decided by
params.looks_like_lark.
"""

from __future__ import annotations

import re
from typing import Any

import torch

# The hint every refused Lark grammar carries: the syntax and why the text was read as Lark.
LARK_FIX = (
    'fix the Lark grammar (a start rule, e.g. start: "yes" | "no"; llguidance\'s syntax: '
    "https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md). It was read as Lark because a "
    "line starts with a rule definition `name:` and it holds no `::=`; an EBNF grammar defines its rules "
    "with `::=` and a root rule"
)
# llguidance's messages start "at 3(8): " or "3(8): " (line 3, column 8) and end with the source lines and
# a caret under the column; the first line is the reason.
_POSITION = re.compile(r"^(?:at )?(\d+)\((\d+)\):\s*")


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
    except ImportError as error:
        raise ValueError(
            f"Lark grammars need the llguidance package, which is not installed ({error}): "
            "pip install llguidance"
        ) from None
    return llguidance


def reason(message: str) -> str:
    """llguidance's message as one line: its position as 'line L, column C', without the source excerpt."""
    first = message.strip().splitlines()[0].strip() if message.strip() else "the grammar is invalid"
    position = _POSITION.match(first)
    if position:
        first = f"at line {position[1]}, column {position[2]}: {first[position.end() :]}"
    return first.rstrip(".")


def build_lark(text: str) -> str:
    """llguidance's grammar for a Lark text, checked without a tokenizer; ValueError (the reason and
    LARK_FIX) if llguidance refuses it."""
    grammar = _llguidance().LLMatcher.grammar_from_lark(text)
    error = lark_error(grammar)
    if error:
        raise ValueError(f"invalid Lark grammar: {error}; {LARK_FIX}")
    return grammar


def lark_error(grammar: str, tokenizer: Any = None) -> str:
    """llguidance's reason for refusing a grammar (from grammar_from_lark), '' when it is valid."""
    message = _llguidance().LLMatcher.validate_grammar(grammar, tokenizer)
    return reason(message) if message else ""


def lark_reason(text: str) -> str:
    """Why llguidance's Lark front end refuses `text` ('' if it takes it): for the error of a grammar that
    is neither EBNF nor Lark."""
    try:
        return lark_error(_llguidance().LLMatcher.grammar_from_lark(text))
    except ValueError as error:  # llguidance missing
        return str(error)


class LarkGrammar:
    """A compiled Lark grammar: a matcher at the start, which every new state copies (~10 us)."""

    __slots__ = ("matcher", "stop_token_ids")

    def __init__(self, matcher: Any, stop_token_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.stop_token_ids = stop_token_ids


class LarkCompiler:
    """Compiles Lark grammars against one tokenizer (llguidance's view of it, built on first use: ~0.5 s
    for SmolLM2's). Used by the compile pool's one thread only."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = frozenset(stop_token_ids)
        self._tokenizer: Any = None

    def _ll_tokenizer(self) -> Any:
        if self._tokenizer is None:
            llg = _llguidance()
            try:
                self._tokenizer = llg.hf.from_tokenizer(
                    self._hf_tokenizer,
                    n_vocab=self.vocab_size,
                    eos_token=sorted(self._stop_token_ids) or None,
                )
            except Exception as error:  # noqa: BLE001 - reported as the request's error, with the cause
                raise ValueError(
                    f"Lark grammars cannot read this model's tokenizer ({type(error).__name__}: {error}): "
                    "llguidance needs a Hugging Face fast tokenizer (tokenizer.json); use an EBNF grammar "
                    "(root ::= ...) instead, which xgrammar runs"
                ) from error
        return self._tokenizer

    def compile(self, grammar: str) -> LarkGrammar:
        """grammar: build_lark's output."""
        llg = _llguidance()
        matcher = llg.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            error = reason(matcher.get_error())
            raise ValueError(f"the Lark grammar could not be compiled: {error}; {LARK_FIX}")
        stops = self._stop_token_ids or frozenset(self._ll_tokenizer().eos_tokens)
        return LarkGrammar(matcher, stops)


class LarkGrammarState:
    """One sequence's place in a Lark grammar (an llguidance LLMatcher), with GrammarState's interface and
    its meaning of the end: is_terminated once a stop token has been accepted where the grammar is
    complete (llguidance's own is_stopped() turns true before it, when only a stop token may follow)."""

    __slots__ = ("_matcher", "_stop_token_ids", "vocab_size", "num_accepted", "_ended")

    def __init__(self, compiled: LarkGrammar, vocab_size: int) -> None:
        self._matcher = compiled.matcher.deep_copy()
        self._stop_token_ids = compiled.stop_token_ids
        self.vocab_size = vocab_size
        self.num_accepted = 0
        self._ended = False

    @property
    def bitmask_width(self) -> int:
        """int32 words per bitmask row: ceil(vocab_size / 32)."""
        return (self.vocab_size + 31) // 32

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into bitmask[row] (a CPU int32 tensor [rows, >= bitmask_width];
        bit b of word w = token 32 * w + b, llguidance's layout too); words past bitmask_width are 0."""
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2:
            raise ValueError(
                f"the bitmask is {bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}: the grammar "
                "fills a 2-D torch.int32 tensor on the CPU"
            )
        width = self.bitmask_width
        target = bitmask[row]
        if not target.is_contiguous() or target.numel() < width:
            raise ValueError(
                f"bitmask row {row} holds {target.numel()} words (contiguous: {target.is_contiguous()}): "
                f"the grammar needs {width} contiguous words"
            )
        # llguidance writes exactly its vocabulary's words (it refuses any other size) through the pointer
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), width * 4)
        if target.numel() > width:
            target[width:] = 0

    def accept(self, token_id: int) -> bool:
        """Advances by one token; False (state unchanged) when the grammar does not allow it."""
        if self._ended:
            return False
        matcher = self._matcher
        if token_id in self._stop_token_ids:
            if not matcher.is_accepting() or not matcher.consume_token(token_id):
                return False
            self._ended = True
        elif matcher.is_stopped() or matcher.try_consume_tokens([token_id]) != 1:
            return False  # try_consume_tokens leaves the matcher where it was on a refusal
        self.num_accepted += 1
        return True

    def _copy(self) -> LarkGrammarState:
        state = LarkGrammarState.__new__(LarkGrammarState)
        state._matcher = self._matcher.deep_copy()
        state._stop_token_ids = self._stop_token_ids
        state.vocab_size = self.vocab_size
        state.num_accepted = self.num_accepted
        state._ended = self._ended
        return state

    def after(self, token_ids: list[int]) -> LarkGrammarState:
        """A new state: this one's place, then these tokens taken (a verify row of speculative decoding).
        This state does not move. ValueError if the grammar refuses one."""
        state = self._copy()
        for token_id in token_ids:
            if not state.accept(token_id):
                raise ValueError(f"the grammar refuses token {token_id} after {state.num_accepted} tokens")
        return state

    def valid_prefix_len(self, token_ids: list[int]) -> int:
        """How many of these tokens the grammar accepts in a row from here (a copy takes them)."""
        probe = self._copy()
        for count, token_id in enumerate(token_ids):
            if not probe.accept(token_id):
                return count
        return len(token_ids)

    @property
    def is_terminated(self) -> bool:
        """The output is complete and its stop token was accepted."""
        return self._ended
