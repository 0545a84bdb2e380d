"""The fewest tokens any complete output of a grammar can take, so that a request whose max_tokens cannot
hold one is refused (400, ValueError offline) before any decoding instead of ending as an unfinished prefix.

The bound must never refuse a request that could finish, so it is a lower bound, computed from two things:

- the grammar, as xgrammar prints it (EBNF: rules of strings, character classes, sequences, choices,
  repetition and rule references; JSON schemas and regexes are converted to it by xgrammar), read by
  ebnf_reader.py. The cost of
  the cheapest string each rule derives is a fixpoint over the rules (recursion such as JSON values
  included: every rule's cost is that of some finite derivation, and the optimal one is reached within
  as many rounds as there are rules).
- the tokenizer's byte table: for each byte value, the longest token holding it. A byte b costs
  1 / longest(b) tokens: a token of k bytes holds only bytes whose longest token is >= k, so its bytes
  cost at most k * (1 / k) = 1 together, and any output costs at least its bytes' sum in tokens. This is
  far tighter than bytes / the longest token overall (81 bytes of spaces in SmolLM2, whose quotes, braces
  and colons are in no token longer than 5 bytes and whose digits are tokens of their own).

No end-of-sequence token is counted: the grammar is satisfied once its text is complete; at max_tokens
equal to the bound such an output ends complete, with finish_reason "length" instead of "stop" (a choice
of one-token words at max_tokens 1, as classifiers send, keeps working).

Lark grammars (llguidance) are not checked: llguidance gives no printable form of a grammar to measure.
A construct this reader does not know (token-level elements, structural tags) means no bound, never a
guess. See docs/structured_outputs.md.
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from fitserve.structured.ebnf_reader import CharClass, Chars, GrammarReadError, RegexLeaf, read_ebnf
from fitserve.structured.params import GrammarSpec

INF = math.inf
# Bounds kept per spec (the compile cache's size: a spec sent again is not measured again).
BOUND_CACHE_SIZE = 512
# Rounding slack: a float sum of k terms of 1/k may come out a hair above an integer.
_SLACK = 1e-6
_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}
_SHORTER = {
    "json": "or shorten the schema's shortest answer (fewer required properties, lower minItems / minLength)",
    "json_object": "",
    "regex": "or loosen the regex so that a shorter match exists",
    "choice": "or offer a shorter choice",
    "grammar": "or give the grammar a shorter sentence",
}


# ---- the cheapest derivation -------------------------------------------------------------------------
class ByteCosts:
    """What one byte of output costs: 1 each (counting bytes), or 1 / the longest token holding it."""

    def __init__(self, per_byte: list[float]) -> None:
        self.per_byte = per_byte
        self.cheapest_high = min(per_byte[0x80:])  # any byte of a multi-byte UTF-8 character

    @classmethod
    def bytes(cls) -> ByteCosts:
        return cls([1.0] * 256)

    def escaped(self) -> ByteCosts:
        """These costs inside a JSON string, where a quote, a backslash, a slash or a control character may
        be written as an escape: \\ and a letter at the least, so it costs no more than that."""
        return _EscapedCosts(self.per_byte)

    def code_point(self, value: int) -> float:
        return sum(self.per_byte[b] for b in chr(value).encode("utf-8", "surrogatepass"))

    def chars(self, leaf: Chars) -> float:
        total = 0.0
        for item in leaf.items:
            if isinstance(item, tuple):  # \xNN: the code point's UTF-8 bytes, or the raw byte
                total += min(self.per_byte[item[1]], self.code_point(item[1]))
            else:
                total += self.code_point(item)
        return total

    def char_class(self, leaf: CharClass) -> float:
        if leaf.negated:
            excluded = set()
            for low, high in leaf.ranges:
                excluded.update(range(max(low, 0), min(high, 0x7F) + 1))
            ascii_costs = [self.per_byte[b] for b in range(0x80) if b not in excluded]
            # anything else: at least one byte of 0x80 or more (a lower bound, never above)
            return min([*ascii_costs, self.cheapest_high])
        best = INF
        for low, high in leaf.ranges:
            if low > high:
                continue
            if low < 0x80:
                best = min(best, *(self.per_byte[b] for b in range(low, min(high, 0x7F) + 1)))
            if high >= 0x80:  # up to 0xFF may be one raw byte (a \xNN escape): the cheaper reading
                start = max(low, 0x80)
                length = 1 if start <= 0xFF else len(chr(start).encode("utf-8", "surrogatepass"))
                best = min(best, length * self.cheapest_high)
        return best


# Characters a JSON string writes as an escape (\" \\ \/ and the controls): in a JSON-string Regex element
# they may cost their escape's bytes instead of their own. xgrammar 0.2.8 matches the pattern on the raw
# bytes and escapes nothing; the bound holds either way.
_JSON_ESCAPED = frozenset([*range(0x20), 0x22, 0x2F, 0x5C])


class _EscapedCosts(ByteCosts):
    def __init__(self, per_byte: list[float]) -> None:
        super().__init__(per_byte)
        self.floor = per_byte[ord("\\")] + min(per_byte[b] for b in b'"\\/bfnrtu')  # \\uXXXX is longer

    def code_point(self, value: int) -> float:
        raw = super().code_point(value)
        return min(raw, self.floor) if value in _JSON_ESCAPED else raw

    def chars(self, leaf: Chars) -> float:
        total = 0.0
        for item in leaf.items:
            raw = ByteCosts.chars(self, Chars((item,)))
            value = item[1] if isinstance(item, tuple) else item
            total += min(raw, self.floor) if value in _JSON_ESCAPED else raw
        return total

    def char_class(self, leaf: CharClass) -> float:
        raw = super().char_class(leaf)
        inside = {c for c in _JSON_ESCAPED if any(low <= c <= high for low, high in leaf.ranges)}
        escapable = len(inside) < len(_JSON_ESCAPED) if leaf.negated else bool(inside)
        return min(raw, self.floor) if escapable else raw


def _regex_cost(leaf: RegexLeaf, costs: ByteCosts) -> float:
    try:
        import xgrammar

        text = str(xgrammar.Grammar.from_regex(leaf.pattern))
    except (ImportError, RuntimeError, ValueError) as error:
        raise GrammarReadError(f"the pattern {leaf.pattern!r} could not be read: {error}") from None
    return cheapest(read_ebnf(text), costs.escaped() if leaf.json_string else costs)


def _leaf_costs(node: Any, costs: ByteCosts) -> Any:
    """The expression with each string, class and regex replaced by its cost."""
    if isinstance(node, RegexLeaf):
        return _regex_cost(node, costs)
    if isinstance(node, Chars):
        return costs.chars(node)
    if isinstance(node, CharClass):
        return costs.char_class(node)
    if node[0] in ("alt", "seq"):
        return (node[0], tuple(_leaf_costs(item, costs) for item in node[1]))
    if node[0] == "rep":
        return ("rep", _leaf_costs(node[1], costs), node[2])
    return node


def _cost(node: Any, values: dict[str, float]) -> float:
    if isinstance(node, float):
        return node
    kind = node[0]
    if kind == "ref":
        return values.get(node[1], 0.0)  # an unknown rule: nothing assumed
    if kind == "seq":
        return sum(_cost(item, values) for item in node[1])
    if kind == "alt":
        return min(_cost(item, values) for item in node[1])
    count = node[2]
    return 0.0 if count == 0 else count * _cost(node[1], values)


def _refs(node: Any, out: list[str]) -> None:
    if isinstance(node, float):
        return
    if node[0] == "ref":
        out.append(node[1])
    elif node[0] == "rep":
        _refs(node[1], out)
    elif node[0] in ("alt", "seq"):
        for item in node[1]:
            _refs(item, out)


def _dependencies_first(bodies: dict[str, Any], root: str) -> list[str]:
    """The rules reachable from root, each after the rules it uses (recursion aside): most settle in one
    round."""
    order: list[str] = []
    seen = {root}
    stack = [(root, iter(_children(bodies, root)))]
    while stack:
        name, children = stack[-1]
        child = next(children, None)
        if child is None:
            stack.pop()
            order.append(name)
        elif child not in seen and child in bodies:
            seen.add(child)
            stack.append((child, iter(_children(bodies, child))))
    return order


def _children(bodies: dict[str, Any], name: str) -> list[str]:
    out: list[str] = []
    _refs(bodies[name], out)
    return out


def cheapest(rules: dict[str, Any], costs: ByteCosts, root: str = "root") -> float:
    """The least cost of any string `root` derives (INF when it derives no finite string). Fixpoint: every
    rule starts at INF and is lowered to the cost of its body until nothing changes; each value is always
    the cost of some derivation, and the cheapest derivation tree needs no rule twice on a path, so the
    rules settle within len(rules) + 1 rounds."""
    if root not in rules:
        raise GrammarReadError(f"the grammar has no {root!r} rule")
    bodies = {name: _leaf_costs(body, costs) for name, body in rules.items()}
    order = _dependencies_first(bodies, root)
    values = dict.fromkeys(bodies, INF)
    for _ in range(len(order) + 2):
        changed = False
        for name in order:
            value = _cost(bodies[name], values)
            if value < values[name]:
                values[name] = value
                changed = True
        if not changed:
            return values[root]
    raise GrammarReadError("the rule costs did not settle")  # cannot happen (see above): no bound


# ---- the tokenizer's side -----------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenCosts:
    """A tokenizer's costs: a byte's share of a token (1 / the longest token holding it) and the longest
    token in bytes (named in the message)."""

    costs: ByteCosts
    longest_token: int


_token_costs: dict[int, tuple[weakref.ref[Any], TokenCosts | None]] = {}
_token_costs_lock = threading.Lock()


def token_costs(tokenizer: Any) -> TokenCosts | None:
    """The costs for this tokenizer (built once, ~50 ms for a 49k vocabulary), None when it has no token
    byte table (fitserve/token_bytes.py): then no bound is given."""
    from fitserve.token_bytes import token_byte_table

    entry = _token_costs.get(id(tokenizer))
    if entry is not None and entry[0]() is tokenizer:
        return entry[1]
    table = token_byte_table(tokenizer)
    result = None
    if table is not None and table.bytes_by_id:
        longest = [0] * 256
        for data in table.bytes_by_id:  # special tokens included: their text may be matched, so no less
            size = len(data)
            for value in set(data):
                if longest[value] < size:
                    longest[value] = size
        top = max(longest)
        if top > 0:
            # a byte no token holds gets the overall longest token's share: never more than it may cost
            result = TokenCosts(ByteCosts([1.0 / (size or top) for size in longest]), top)
    with _token_costs_lock, contextlib.suppress(TypeError):  # no weak reference: not cached
        _token_costs[id(tokenizer)] = (weakref.ref(tokenizer, _forget(id(tokenizer))), result)
    return result


def _forget(key: int) -> Any:
    return lambda _: _token_costs.pop(key, None)


# ---- per spec -------------------------------------------------------------------------------------------
_rules_cache: OrderedDict[GrammarSpec, dict[str, Any] | None] = OrderedDict()
_rules_lock = threading.Lock()


def spec_rules(spec: GrammarSpec, grammar: Any = None) -> dict[str, Any] | None:
    """The rules of the spec's grammar (`grammar`: its xgrammar Grammar, if at hand; built otherwise), cached
    by spec; None for a Lark spec or a grammar this reader cannot read (no bound then)."""
    with _rules_lock:
        if spec in _rules_cache:
            _rules_cache.move_to_end(spec)
            return _rules_cache[spec]
    rules = None
    if spec.kind != "lark":
        if grammar is None:
            from fitserve.structured.backend import build_grammar

            grammar = build_grammar(spec)
        try:
            rules = read_ebnf(str(grammar))
            if "root" not in rules:
                rules = None
        except (GrammarReadError, RecursionError):  # RecursionError: nesting deeper than Python's stack
            rules = None
    with _rules_lock:
        _rules_cache[spec] = rules
        while len(_rules_cache) > BOUND_CACHE_SIZE:
            _rules_cache.popitem(last=False)
    return rules


@dataclass(frozen=True)
class OutputBound:
    """The shortest output's bytes and the fewest tokens any complete output takes."""

    min_bytes: float
    min_tokens: float  # INF when the grammar has no finite output
    longest_token: int


# (spec, id(the tokenizer's TokenCosts)) -> (those TokenCosts, the bound): a spec sent again costs a lookup
_bounds: OrderedDict[tuple[GrammarSpec, int], tuple[TokenCosts, OutputBound | None]] = OrderedDict()


def output_bound(spec: GrammarSpec, tokenizer: Any, grammar: Any = None) -> OutputBound | None:
    """The bound for a spec and a tokenizer (~1-10 ms for a schema the first time, cached by spec); None
    when there is none to give (a Lark grammar, an unknown construct, a tokenizer without a byte table)."""
    costs = token_costs(tokenizer)
    if costs is None:
        return None
    key = (spec, id(costs))
    with _rules_lock:
        cached = _bounds.get(key)
        if cached is not None and cached[0] is costs:
            _bounds.move_to_end(key)
            return cached[1]
    bound = None
    rules = spec_rules(spec, grammar)
    if rules is not None:
        try:
            min_bytes = cheapest(rules, ByteCosts.bytes())
            tokens = cheapest(rules, costs.costs)
        except (GrammarReadError, RecursionError):
            tokens = None
        if tokens is not None:
            min_tokens = tokens if tokens == INF else float(max(0, math.ceil(tokens - _SLACK)))
            bound = OutputBound(min_bytes, min_tokens, costs.longest_token)
    with _rules_lock:
        _bounds[key] = (costs, bound)
        while len(_bounds) > BOUND_CACHE_SIZE:
            _bounds.popitem(last=False)
    return bound


def check_max_tokens(
    spec: GrammarSpec,
    tokenizer: Any,
    max_tokens: int,
    *,
    what: str | None = None,
    grammar: Any = None,
    limit: str | None = None,
    fix: str | None = None,
) -> None:
    """ValueError naming max_tokens, the bound and the fix when no complete output of the spec's grammar
    fits in max_tokens. what: the constraint's kind as the request named it ("choice" for a choice; the
    spec's kind by default). limit / fix: how to name the limit and how to raise it, when it is not the
    request's own max_tokens (e.g. what the context leaves; fix may hold "{needed}", the bound)."""
    bound = output_bound(spec, tokenizer, grammar)
    if bound is None or bound.min_tokens <= max_tokens:
        return
    kind = what or spec.kind
    name = _WHAT.get(kind, kind)
    limit = limit or f"max_tokens is {max_tokens}"
    if bound.min_tokens == INF:
        raise ValueError(
            f"the {name} has no finite output, so no max_tokens can hold one: fix it so that some output ends"
        )
    needed = int(bound.min_tokens)
    fix = fix.format(needed=needed) if fix else f"raise max_tokens to at least {needed}"
    shorter = _SHORTER.get(kind, "")
    raise ValueError(
        f"{limit}, but the {name} needs at least {needed} tokens for a complete output (its shortest valid "
        f"output is {int(bound.min_bytes)} bytes, and no valid output fits in fewer of this model's tokens): "
        f"{fix}" + (f", {shorter}" if shorter else "")
    )
