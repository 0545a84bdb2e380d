"""The engine's side of structured outputs: grammars compiled in a worker thread and cached by spec,
requests held until their grammar is ready (nothing else waits), and each sequence's matcher advanced
by the tokens it is given.

Flow: Engine.add_request -> submit(spec) (a cached compile is shared, a new one queued on the pool) and
hold(parent, children, future): the children reach the scheduler only once take_ready() finds the
compile done and has given each child its own GrammarState (n > 1: one per sample). The sampler masks
each constrained row with its state's bitmask (SamplingRow.grammar); rows with a grammar read the exact
token history, so the engine takes a step's tokens before planning the next one, and advance() has moved
every matcher by its token before the next mask is filled.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fitserve.structured.backend import GrammarCompiler, GrammarState, build_grammar, new_state, preload
from fitserve.structured.lark import LarkGrammarState
from fitserve.structured.min_tokens import check_max_tokens, token_costs
from fitserve.structured.params import GrammarSpec, StructuredOutputsParams

if TYPE_CHECKING:
    from fitserve.core.request import Request

logger = logging.getLogger("fitserve")

# Compiled grammars kept for reuse (the oldest beyond this are dropped).
GRAMMAR_CACHE_SIZE = 512


@dataclass
class _Held:
    future: Future
    children: list[Request]


@dataclass
class Rejection:
    request: Request
    token_id: int
    message: str


class StructuredOutputManager:
    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int], preload: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        # the logits' width; a tokenizer with more tokens than the model's vocabulary (a tiny test model)
        # widens the bitmask, and the sampler reads only the logits' columns of it
        try:
            tokenizer_size = len(tokenizer)
        except TypeError:
            tokenizer_size = 0
        self.vocab_size = max(vocab_size, tokenizer_size)
        self._stop_token_ids = sorted(stop_token_ids)
        # the compile thread; with `preload`, its first job imports xgrammar (~0.3 s), so the first
        # constrained request does not pay for it on the engine's thread (see preload())
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fitserve-grammar")
        self._preloading: Future | None = None
        if preload:
            self.preload()
        self._compiler: GrammarCompiler | None = None  # made in the pool's thread on first use
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._held: dict[str, _Held] = {}
        self.cache_hits = 0
        self.cache_misses = 0

    def preload(self) -> Future:
        """Imports xgrammar on the compile thread (once; later calls return the same job), and measures
        the tokenizer's token lengths for max_tokens checks (~50 ms for a 49k vocabulary)."""
        if self._preloading is None:
            self._preloading = self._pool.submit(self._preload)
        return self._preloading

    def _preload(self) -> None:
        preload()
        token_costs(self._tokenizer)

    # ---- compiling ----------------------------------------------------------------------------------
    def submit(
        self,
        params: StructuredOutputsParams,
        max_tokens: int | None = None,
        limit: str | None = None,
        fix: str | None = None,
    ) -> Future:
        """The compiled grammar of these params, as a future (a cached one when the spec was seen).
        A new spec is checked here (its grammar built: ~0.3 ms for a 10-field schema), so a bad
        schema, regex or grammar raises ValueError now; the compile itself (~7 ms) runs in the pool.
        With max_tokens, a grammar none of whose outputs fits in it raises ValueError too (its bound is
        measured once per spec, ~1-10 ms, and cached; limit / fix: min_tokens.check_max_tokens's)."""
        spec = params.to_spec()
        future = self._cache.get(spec)
        if future is not None and not (future.done() and future.exception() is not None):
            if max_tokens is not None:
                check_max_tokens(spec, self._tokenizer, max_tokens, what=params.kind, limit=limit, fix=fix)
            self._cache.move_to_end(spec)
            self.cache_hits += 1
            return future
        grammar = build_grammar(spec)
        if max_tokens is not None:
            check_max_tokens(
                spec, self._tokenizer, max_tokens, what=params.kind, grammar=grammar, limit=limit, fix=fix
            )
        self.cache_misses += 1
        future = self._pool.submit(self._compile, spec, grammar)
        self._cache[spec] = future
        while len(self._cache) > GRAMMAR_CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def _compile(self, spec: GrammarSpec, grammar: Any) -> Any:
        if self._compiler is None:
            try:
                self._compiler = GrammarCompiler(self._tokenizer, self.vocab_size, self._stop_token_ids)
            except Exception as error:  # noqa: BLE001 - reported as the request's error, with the cause
                raise ValueError(
                    f"structured outputs cannot read this model's tokenizer ({type(error).__name__}: "
                    f"{error}): serve the model from a folder with a Hugging Face tokenizer "
                    "(tokenizer.json) to use them"
                ) from error
        return self._compiler.compile(spec, grammar)

    def compile_now(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar, waiting for it (tests and tools; the engine never waits)."""
        return self.submit(params).result()

    def new_state(self, compiled: Any) -> GrammarState | LarkGrammarState:
        return new_state(compiled, self.vocab_size)

    # ---- requests waiting for their grammar ---------------------------------------------------------
    def hold(self, parent_id: str, children: list[Request], future: Future) -> None:
        self._held[parent_id] = _Held(future, children)

    def drop(self, parent_id: str) -> bool:
        """Forgets a held request (aborted); True if it was held."""
        return self._held.pop(parent_id, None) is not None

    @property
    def has_held(self) -> bool:
        return bool(self._held)

    def take_ready(self, wait_s: float = 0.0) -> list[tuple[str, list[Request], BaseException | None]]:
        """The held requests whose compile finished: (parent id, children, the compile's error or None).
        Each child of a successful one has its own GrammarState. wait_s: how long to wait for one when
        none is ready (the engine passes a few ms when it has nothing else to do)."""
        if not self._held:
            return []
        if wait_s > 0 and not any(held.future.done() for held in self._held.values()):
            futures = [held.future for held in self._held.values()]
            concurrent.futures.wait(futures, timeout=wait_s, return_when=concurrent.futures.FIRST_COMPLETED)
        ready = []
        for parent_id, held in list(self._held.items()):
            if not held.future.done():
                continue
            del self._held[parent_id]
            error = held.future.exception()
            if error is None:
                compiled = held.future.result()
                for child in held.children:
                    child.grammar = self.new_state(compiled)
            ready.append((parent_id, held.children, error))
        return ready

    # ---- decoding -----------------------------------------------------------------------------------
    def advance(self, progressed: list[Request]) -> tuple[list[Request], list[Rejection]]:
        """Moves each constrained request's matcher by its newest token. Returns the requests whose
        grammar is now complete (they stop) and those whose token the grammar refused."""
        terminated: list[Request] = []
        rejected: list[Rejection] = []
        for request in progressed:
            state: GrammarState | LarkGrammarState | None = getattr(request, "grammar", None)
            if state is None or not request.output_token_ids:
                continue
            if state.is_terminated:
                continue
            token_id = request.output_token_ids[-1]
            if not state.accept(token_id):
                rejected.append(
                    Rejection(
                        request,
                        token_id,
                        f"the structured-output grammar refused token {token_id} after {state.num_accepted} "
                        "tokens (a setting such as min_tokens asked for a token the grammar does not "
                        "allow), so the request was ended: drop that setting",
                    )
                )
            elif state.is_terminated:
                terminated.append(request)
        return terminated, rejected

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
