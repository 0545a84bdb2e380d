"""What a request asks its output to follow: vLLM's `StructuredOutputsParams` (and the older name
`GuidedDecodingParams`), checked on construction, and the canonical `GrammarSpec` the compiler and
its cache key use.

Exactly one of json, json_object, regex, choice or grammar is set. A bad value raises ValueError
naming the field, the value and the fix; the server answers it with a 400 before any decoding.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# Backends a request or --structured-outputs-config may name, as vLLM spells them, and the ones
# fitserve runs (xgrammar; "auto" picks it).
VLLM_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")
BACKENDS = ("auto", "xgrammar")
KINDS = ("json", "json_object", "regex", "choice", "grammar")
# A Lark rule or terminal definition at a line's start: `name:`, `?name:`, `!name:`, `name.2:` (not `::`).
_LARK_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(\.-?[0-9]+)?[ \t]*:(?!:)", re.MULTILINE)


@dataclass(frozen=True)
class GrammarSpec:
    """One compiled grammar's identity: the cache key. spec is text: a JSON schema dumped in its own
    key order (properties are written in that order, so it is part of the identity), the regex, the
    EBNF grammar, the EBNF built from the choices, or the Lark grammar."""

    kind: str  # "json", "json_object", "regex", "grammar" (EBNF; choices become one), "lark"
    spec: str
    any_whitespace: bool = True


@dataclass
class StructuredOutputsParams:
    """vLLM's `vllm.sampling_params.StructuredOutputsParams`.

    json: a JSON schema (a dict, or its JSON text); the output is a JSON value that validates.
    regex: the output fully matches this regular expression.
    choice: the output is exactly one of these strings.
    grammar: an EBNF grammar (xgrammar's GBNF dialect, with a `root` rule), or a Lark grammar (a `start`
        rule; run by llguidance), told apart by looks_like_lark.
    json_object: true = any JSON object.
    disable_any_whitespace: JSON without whitespace between tokens (", " and ": " separators).
    whitespace_pattern: vLLM's outlines-only option; refused (xgrammar has no such setting).
    structural_tag: refused (not supported).
    backend: "auto" or "xgrammar" (vLLM's other backends are refused, naming these).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    backend: str | None = None

    def __post_init__(self) -> None:
        if self.structural_tag is not None:
            raise ValueError(
                "structured output with structural_tag is not supported by fitserve: ask for json, regex, "
                "choice or grammar instead"
            )
        if self.whitespace_pattern is not None:
            raise ValueError(
                f"whitespace_pattern={self.whitespace_pattern!r} (guided_whitespace_pattern) is an outlines "
                "option the xgrammar backend does not have: leave it out (disable_any_whitespace gives "
                "compact JSON)"
            )
        check_backend(self.backend, "backend")
        if self.json_object is False:
            self.json_object = None
        asked = [kind for kind in KINDS if getattr(self, kind) is not None]
        if not asked:
            raise ValueError(
                "structured_outputs asks for nothing: set exactly one of json, json_object, regex, choice "
                "or grammar"
            )
        if len(asked) > 1:
            raise ValueError(
                f"structured_outputs sets {len(asked)} constraints ({', '.join(asked)}), but one request "
                "takes one: keep exactly one of json, json_object, regex, choice or grammar"
            )

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) is not None)

    def to_spec(self) -> GrammarSpec:
        """The canonical spec to compile (ValueError for a malformed value)."""
        any_whitespace = not self.disable_any_whitespace
        kind = self.kind
        if kind == "json":
            return GrammarSpec("json", _schema_text(self.json), any_whitespace)
        if kind == "json_object":
            if self.json_object is not True:
                raise ValueError(f"json_object={self.json_object!r} must be true (or left out)")
            return GrammarSpec("json_object", "", any_whitespace)
        if kind == "regex":
            if not isinstance(self.regex, str) or not self.regex:
                raise ValueError(f"regex={self.regex!r} must be a non-empty regular expression string")
            return GrammarSpec("regex", self.regex)
        if kind == "grammar":
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise ValueError(
                    f"grammar={self.grammar!r} must be a non-empty grammar: EBNF with a root rule, e.g. "
                    'root ::= "yes" | "no", or Lark with a start rule, e.g. start: "yes" | "no"'
                )
            return GrammarSpec("lark" if looks_like_lark(self.grammar) else "grammar", self.grammar)
        return GrammarSpec("grammar", choice_grammar(self.choice))


def looks_like_lark(grammar: str) -> bool:
    """The rule that sends a grammar to llguidance's Lark front end instead of xgrammar's EBNF: some line
    starts with a Lark definition (`name:`, `?name:`, `!name:` or `name.2:`, spaces before it allowed)
    and `::=`, EBNF's definition sign, appears nowhere in the text."""
    return "::=" not in grammar and _LARK_DEFINITION.search(grammar) is not None


# vLLM's older name for the same parameters (vllm.sampling_params.GuidedDecodingParams).
GuidedDecodingParams = StructuredOutputsParams


def check_backend(backend: object, where: str) -> None:
    """Refuses a backend fitserve does not run, naming the ones it does."""
    if backend is None:
        return
    if backend not in VLLM_BACKENDS and not (isinstance(backend, str) and backend.startswith("xgrammar:")):
        raise ValueError(
            f"{where}={backend!r} is not a structured-output backend: use one of {', '.join(BACKENDS)}"
        )
    if backend not in BACKENDS and not str(backend).startswith("xgrammar:"):
        raise ValueError(
            f"{where}={backend!r} is not available in fitserve, which runs structured outputs with "
            f"xgrammar: set {where} to one of {', '.join(BACKENDS)} (or leave it out)"
        )


def choice_grammar(choices: object) -> str:
    """An EBNF grammar whose only sentences are the given strings."""
    if not isinstance(choices, (list, tuple)):
        raise ValueError(f'choice={choices!r} must be a list of strings, e.g. ["yes", "no"]')
    if not choices:
        raise ValueError("choice is an empty list: give at least one string the output may be")
    for item in choices:
        if not isinstance(item, str) or not item:
            raise ValueError(f"choice holds {item!r}: every choice must be a non-empty string")
    alternatives = " | ".join(json.dumps(item, ensure_ascii=False) for item in dict.fromkeys(choices))
    return f"root ::= {alternatives}"


def _schema_text(schema: object) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"the JSON schema is not valid JSON ({error.msg} at character {error.pos}): send the schema "
                "as a JSON object"
            ) from None
    if schema is True:
        schema = {}
    if schema is False:
        raise ValueError(
            "the JSON schema is false, which no output satisfies: send a schema that allows some output"
        )
    if not isinstance(schema, dict):
        raise ValueError(
            f"the JSON schema must be an object, not {type(schema).__name__} ({schema!r:.60}): send a schema "
            'such as {"type": "object", "properties": {...}}'
        )
    check_schema_features(schema)
    return json.dumps(schema, ensure_ascii=False)  # key order kept: properties are written in it


# JSON-schema keywords the xgrammar backend would ignore; a schema using one is refused, so no output
# is held to less than the schema asks.
UNSUPPORTED_SCHEMA_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "dependentSchemas",
    "dependentRequired",
    "dependencies",
    "unevaluatedProperties",
    "unevaluatedItems",
    "contains",
    "minContains",
    "maxContains",
    "patternProperties",
    "propertyNames",
    "uniqueItems",
    "multipleOf",
)


def check_schema_features(schema: Any, path: str = "#") -> None:
    """Raises ValueError naming the first keyword (and where) the backend cannot enforce."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_schema_features(item, f"{path}/{i}")
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            for name, sub in value.items():
                check_schema_features(sub, f"{path}/{key}/{name}")
            continue
        if key in ("enum", "const", "default", "examples", "required", "description", "title"):
            continue
        if key in UNSUPPORTED_SCHEMA_KEYWORDS:
            raise ValueError(
                f"the JSON schema uses {key!r} at {path}, which fitserve's structured outputs (xgrammar) "
                f"cannot enforce: remove {key!r} from the schema or express it with properties, enum, anyOf "
                "or pattern"
            )
        if isinstance(value, (dict, list)):
            check_schema_features(value, f"{path}/{key}")
