"""Token embedding and the LM head (its own matrix, or the embedding's when tied)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fitserve.layers.linear import default_weight_loader


class VocabParallelEmbedding(nn.Module):
    """Token ids [T] -> embeddings [T, hidden]. A tensor-parallel run would split the vocabulary rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class ParallelLMHead(nn.Module):
    """hidden [N, hidden] -> logits [N, vocab] in float32.

    Tied (`tie_to` given): the head reads the embedding's matrix and owns no parameter of its own, so a
    checkpoint's `lm_head.weight` has nothing to load into and `named_parameters()` does not list it.
    The matmul runs in the model's dtype; only its result is widened to float32 for the sampler.
    """

    def __init__(
        self, vocab_size: int, hidden_size: int, tie_to: VocabParallelEmbedding | None = None
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tied = tie_to is not None
        if tie_to is not None:
            if tuple(tie_to.weight.shape) != (vocab_size, hidden_size):
                raise ValueError(
                    f"cannot tie an LM head of {(vocab_size, hidden_size)} to an embedding of "
                    f"{tuple(tie_to.weight.shape)}"
                )
            self.weight = tie_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
            self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight).to(torch.float32)

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.hidden_size}, tied={self.tied}"
