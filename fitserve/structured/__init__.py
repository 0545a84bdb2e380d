"""Structured outputs (constrained decoding): JSON schema, JSON object, regex, choice and EBNF grammar,
with xgrammar; Lark grammars with llguidance. See docs/structured_outputs.md."""

from fitserve.structured.params import (
    BACKENDS,
    GrammarSpec,
    GuidedDecodingParams,
    StructuredOutputsParams,
    check_backend,
)

__all__ = ["BACKENDS", "GrammarSpec", "GuidedDecodingParams", "StructuredOutputsParams", "check_backend"]
