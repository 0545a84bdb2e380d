"""Token embedding and the LM head (its own matrix, or the embedding's when tied).

Tensor parallel splits the vocabulary: rank r of n holds rows [r * V', (r+1) * V') of both matrices,
V' = cdiv(vocab, n), the last rank's tail padded with zeros. The embedding looks up the ids in its rows
(zeros for the others) and sums over the ranks; the LM head computes its rows' logits and the first rank
joins them (distributed/collectives.gather_logits), the only rank that samples.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fitserve.distributed.collectives import all_reduce, gather_logits
from fitserve.distributed.parallel_state import tp
from fitserve.layers.cpu.fp16_matmul import fp16_matmul, pack_fp16_in_background
from fitserve.layers.linear import WholeTensor, default_weight_loader, dense_linear


def vocab_rows_per_rank(vocab_size: int) -> int:
    return -(-vocab_size // tp().size)


def load_vocab_rows(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copies this rank's rows of a whole [vocab, hidden] checkpoint tensor into param (zeros past the
    vocabulary)."""
    state = tp()
    if state.size == 1:
        default_weight_loader(param, loaded_weight)
        return
    per_rank = param.shape[0]
    start = state.rank * per_rank
    rows = max(0, min(per_rank, loaded_weight.shape[0] - start))
    default_weight_loader(param.narrow(0, 0, rows), loaded_weight.narrow(0, start, rows))
    with torch.no_grad():
        param[rows:].zero_()


def whole_vocab_tensor(param: nn.Parameter, vocab_size: int) -> WholeTensor:
    """The whole [vocab, hidden] matrix of which `param` holds this rank's rows (load_vocab_rows), for
    dummy weights."""
    shape = (vocab_size, param.shape[1])

    def load(whole: torch.Tensor) -> None:
        load_vocab_rows(param, whole)

    return WholeTensor(param, "weight", shape, load, param if tuple(param.shape) == shape else None)


class VocabParallelEmbedding(nn.Module):
    """Token ids [T] -> embeddings [T, hidden]. A tensor-parallel run would split the vocabulary rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.rows_per_rank = vocab_rows_per_rank(num_embeddings)
        self.first_row = tp().rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        # Called after the weight is loaded (a tied LM head prepares its CPU form there).
        self.after_load: list[Callable[[], None]] = []

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        load_vocab_rows(param, loaded_weight)
        for callback in self.after_load:
            callback()

    def whole_tensors(self) -> list[WholeTensor]:
        """The whole embedding matrix, for dummy weights (models/weights.py)."""
        return [whole_vocab_tensor(self.weight, self.num_embeddings)]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp().size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.first_row
        mine = (local >= 0) & (local < self.rows_per_rank)
        embedded = F.embedding(local.clamp(0, self.rows_per_rank - 1), self.weight)
        return all_reduce(embedded * mine.unsqueeze(-1).to(embedded.dtype))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class ParallelLMHead(nn.Module):
    """hidden [N, hidden] -> logits [N, vocab]: float32 on the CPU, the model dtype on CUDA (below).

    Tied (`tie_to` given): the head reads the embedding's matrix and owns no parameter of its own, so a
    checkpoint's `lm_head.weight` has nothing to load into and `named_parameters()` does not list it.
    The matmul runs in the model's dtype. On the CPU its result is widened to float32 for the sampler;
    on CUDA the logits stay in the model dtype: widening 256 rows of Qwen3's 151,936 logits took 121 us
    of a 7 ms decode step on an H100, and the sampler widens only what it edits (its argmax and race
    kernels read bf16 as the same float32 values, so the tokens are the ones float32 logits give).

    On the CPU, a float32 head whose loaded weights float16 holds exactly also gets a prepacked float16
    copy that the matmul reads instead (cpu/fp16_matmul.py): same weights, half the bytes per token.
    """

    def __init__(
        self, vocab_size: int, hidden_size: int, tie_to: VocabParallelEmbedding | None = None
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tied = tie_to is not None
        rows = vocab_rows_per_rank(vocab_size)
        if tie_to is not None:
            if (tie_to.num_embeddings, tie_to.embedding_dim) != (vocab_size, hidden_size):
                raise ValueError(
                    f"cannot tie an LM head of {(vocab_size, hidden_size)} to an embedding of "
                    f"{(tie_to.num_embeddings, tie_to.embedding_dim)}"
                )
            self.weight = tie_to.weight
            tie_to.after_load.append(self._prepare_cpu_weight)
        else:
            self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)
            self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self._fp16_weight: Any | None = None  # prepacked float16 copy (CPU only), None when not exact
        self._fp16_packing: Future | None = None  # that copy while a thread still packs it

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        load_vocab_rows(param, loaded_weight)
        self._prepare_cpu_weight()

    def whole_tensors(self) -> list[WholeTensor]:
        """The whole head matrix, for dummy weights; none when tied (the embedding's is drawn)."""
        return [] if self.tied else [whole_vocab_tensor(self.weight, self.vocab_size)]

    def _prepare_cpu_weight(self) -> None:
        # Packed beside the rest of the start; the first forward takes the copy (waiting if need be).
        self._fp16_weight = None
        self._fp16_packing = pack_fp16_in_background(self.weight)
        # Memory outside parameters and buffers, for the loading log (ModelRunner counts it).
        self.packed_copy_bytes = self.weight.numel() * 2 if self._fp16_packing is not None else 0

    @property
    def fp16_weight(self) -> Any | None:
        """The prepacked float16 copy (CPU only), None when float16 would change a weight; the first
        call waits for the packing thread if it is still at work."""
        if self._fp16_packing is not None:
            self._fp16_weight, self._fp16_packing = self._fp16_packing.result(), None
        return self._fp16_weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits; with tensor parallel, on the first rank only (None on the others)."""
        packed = self.fp16_weight
        if packed is not None and hidden.dtype == torch.float32 and hidden.device.type == "cpu":
            local = fp16_matmul(hidden, packed)
        else:  # on CUDA the model dtype: see the class docstring
            local = dense_linear(hidden, self.weight, out_dtype=None if hidden.is_cuda else torch.float32)
        if tp().size == 1:
            return local
        return gather_logits(local, self.vocab_size)

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.hidden_size}, tied={self.tied}"
