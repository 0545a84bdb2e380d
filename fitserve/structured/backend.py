"""The xgrammar backend: a request's spec to a grammar (checked: a bad schema, regex or grammar is a
ValueError naming it), compiled against the model's tokenizer off the step path, and a matcher per
sequence that accepts tokens and fills a token bitmask. Lark grammars (spec kind "lark") go to
llguidance instead (lark.py), behind the same functions.

Why xgrammar: on the SmolLM2 tokenizer it fills a mask in ~1 us per token (median) against
llguidance's ~12 us, and compiles a 10-field schema in ~7 ms, off the step path and cached
(benchmarks/results/cpu_structured_backends.json).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import torch

from fitserve.structured import lark, min_tokens
from fitserve.structured.params import GrammarSpec, StructuredOutputsParams

# JSON may hold this many whitespace characters between two tokens of its syntax (indentation up to
# 5 levels of 4 spaces fits). Unbounded, a small model can fill max_tokens with newlines inside an
# array (SmolLM2-135M did) and never close the JSON.
MAX_JSON_WHITESPACE = 24
# xgrammar's messages start with a timestamp and a C++ source position; the rest is the reason.
_SOURCE_PREFIX = re.compile(r"\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "grammar": "grammar",
    "lark": "Lark grammar",
}
_FIX = {
    "json": "fix the schema (a JSON Schema object: type, properties, required, items, enum, anyOf, $ref)",
    "json_object": "leave json_object out",
    "regex": "fix the regex (lookaround and backreferences are not supported)",
    "grammar": 'fix the grammar (EBNF with a root rule, e.g. root ::= "yes" | "no")',
    "lark": lark.LARK_FIX,
}
# The Lark reading of a grammar read as EBNF that llguidance takes: only `::=` (in a literal) can do that.
_VALID_LARK = 'valid, but it holds `::=`, which makes it EBNF (split that literal, e.g. "::" "=")'
# A grammar neither xgrammar's EBNF nor llguidance's Lark takes: both reasons, then this.
_EITHER_FIX = (
    'write EBNF with a root rule (root ::= "yes" | "no") or Lark with a start rule (start: "yes" | "no"); '
    "a grammar is read as Lark when a line starts with a rule definition `name:` and it holds no `::=`"
)


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as error:
        raise ValueError(
            f"structured outputs need the xgrammar package, which is not installed ({error}): "
            "pip install xgrammar"
        ) from None
    return xgrammar


def preload() -> None:
    """Imports xgrammar now (a server calls it in a thread at start); a missing package is reported
    by the first request that needs it."""
    with contextlib.suppress(ValueError):
        _xgrammar()


def reason(error: BaseException) -> str:
    """xgrammar's message without its timestamp and source position."""
    text = " ".join(str(error).split())
    return _SOURCE_PREFIX.sub("", text).strip().rstrip(".") or type(error).__name__


def build_grammar(spec: GrammarSpec) -> Any:
    """The xgrammar Grammar for a spec (for a Lark one, llguidance's checked grammar text); ValueError
    (naming the kind, the reason and the fix) if bad. An EBNF grammar xgrammar refuses is tried as Lark
    too, so the error names both readings."""
    if spec.kind == "lark":
        return lark.build_lark(spec.spec)
    xgr = _xgrammar()
    try:
        if spec.kind == "json":
            return xgr.Grammar.from_json_schema(spec.spec, **_json_format(spec))
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', **_json_format(spec))
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.spec)
        return xgr.Grammar.from_ebnf(spec.spec)
    except (RuntimeError, ValueError, TypeError) as error:
        if spec.kind == "grammar":
            raise ValueError(
                f"invalid grammar: as EBNF, {reason(error)}; as Lark, "
                f"{lark.lark_reason(spec.spec) or _VALID_LARK}; {_EITHER_FIX}"
            ) from None
        raise ValueError(f"invalid {_WHAT[spec.kind]}: {reason(error)}; {_FIX[spec.kind]}") from None


def _json_format(spec: GrammarSpec) -> dict[str, Any]:
    if spec.any_whitespace:
        return {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE, "strict_mode": True}
    return {"any_whitespace": False, "separators": (", ", ": "), "strict_mode": True}


def validate(
    params: StructuredOutputsParams,
    max_tokens: int | None = None,
    tokenizer: Any = None,
    limit: str | None = None,
    fix: str | None = None,
) -> GrammarSpec:
    """The request's spec after building its grammar once (no tokenizer needed): every error a bad
    schema, regex or grammar can raise is raised here, as ValueError. With max_tokens and the tokenizer,
    a grammar none of whose outputs fits in max_tokens is a ValueError too (min_tokens.check_max_tokens;
    limit / fix: its wording when the limit is not the request's own max_tokens)."""
    spec = params.to_spec()
    grammar = build_grammar(spec)
    if max_tokens is not None and tokenizer is not None:
        min_tokens.check_max_tokens(
            spec, tokenizer, max_tokens, what=params.kind, grammar=grammar, limit=limit, fix=fix
        )
    return spec


class GrammarCompiler:
    """Compiles specs against one tokenizer. Not thread-safe: one thread (the compile pool's) uses it."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None
        )
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        # Lark grammars' compiler: llguidance's view of the tokenizer is built by the first one
        self._lark = lark.LarkCompiler(tokenizer, vocab_size, stop_token_ids)

    def compile(self, spec: GrammarSpec, grammar: Any = None) -> Any:
        """The compiled grammar of `spec` (`grammar`: its already built Grammar, if at hand): an xgrammar
        CompiledGrammar, or a lark.LarkGrammar for a Lark spec."""
        if grammar is None:
            grammar = build_grammar(spec)
        if spec.kind == "lark":
            return self._lark.compile(grammar)
        try:
            return self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as error:
            raise ValueError(f"the {_WHAT[spec.kind]} could not be compiled: {reason(error)}") from None


def new_state(compiled: Any, vocab_size: int) -> GrammarState | lark.LarkGrammarState:
    """A sequence's state at the start of a compiled grammar (GrammarCompiler.compile's result)."""
    if isinstance(compiled, lark.LarkGrammar):
        return lark.LarkGrammarState(compiled, vocab_size)
    return GrammarState(compiled, vocab_size)


class GrammarState:
    """One sequence's place in its grammar: which tokens may come next, advanced token by token."""

    __slots__ = ("_matcher", "vocab_size", "num_accepted")

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        self._matcher = _xgrammar().GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.num_accepted = 0

    @property
    def bitmask_width(self) -> int:
        """int32 words per bitmask row: ceil(vocab_size / 32)."""
        return (self.vocab_size + 31) // 32

    @property
    def matcher(self) -> Any:
        """The xgrammar GrammarMatcher (batch_fill.py hands many of them to xgrammar at once)."""
        return self._matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into bitmask[row] (a CPU int32 tensor [rows, bitmask_width];
        bit b of word w = token 32 * w + b)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advances by one token; False (state unchanged) when the grammar does not allow it."""
        accepted = bool(self._matcher.accept_token(token_id))
        self.num_accepted += accepted
        return accepted

    def after(self, token_ids: list[int]) -> GrammarState:
        """A new state: this one's place, then these tokens taken (a verify row of speculative decoding
        is masked by the grammar after the drafts before it). This state does not move. ValueError if the
        grammar refuses one (drafts are cut to valid_prefix_len first)."""
        state = GrammarState.__new__(GrammarState)
        state._matcher = self._matcher.fork()
        state.vocab_size = self.vocab_size
        state.num_accepted = self.num_accepted
        for token_id in token_ids:
            if not state.accept(token_id):
                raise ValueError(f"the grammar refuses token {token_id} after {state.num_accepted} tokens")
        return state

    def valid_prefix_len(self, token_ids: list[int]) -> int:
        """How many of these tokens (speculative drafts, say) the grammar accepts in a row from here;
        this state does not move (a copy of the matcher takes them)."""
        probe = self._matcher.fork()
        for count, token_id in enumerate(token_ids):
            if probe.is_terminated() or not probe.accept_token(token_id):
                return count
        return len(token_ids)

    @property
    def is_terminated(self) -> bool:
        """The output is complete and its stop token was accepted."""
        return bool(self._matcher.is_terminated())
