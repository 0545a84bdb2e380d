"""`eagle3` speculation: an EAGLE-3 draft head, in its released checkpoint format, drafts k tokens per
request from the target's own hidden states.

The checkpoint (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B; config `LlamaForCausalLMEagle3`): one decoder
layer `midlayer` whose q/k/v projections read [input_layernorm(embedding(token)), hidden_norm(hidden)]
(2 x hidden in), its MLP, `fc` (3 x the target's hidden -> hidden) over the target's residual streams at
three layers, `norm`, `lm_head` over a reduced draft vocabulary (`draft_vocab_size`) and `d2t` (draft id
-> target id offset; `t2d` is not needed). The embedding is the target's, unless the checkpoint has one.

The target's layers read: the config's `eagle_aux_hidden_state_layer_ids` (or `eagle_config`'s), else
vLLM's default for Llama, (2, L // 2, L - 3): the residual stream entering those layers, as HF's
`output_hidden_states` numbers them. The target copies them into a preallocated buffer inside its
forward (DecoderModel.keep_aux_hidden, only once this head is configured: a model without it runs its
forward unchanged), so its CUDA graphs, captured after this head is built, replay the copies too.

The head's row at position p reads (token p + 1, the target's streams at p) and predicts token p + 2. Its
own paged KV cache (one layer, a pool of as many blocks as the target's) holds the positions whose
streams came from the target. After each target step the engine hands the step's rows here
(`after_launch`): kept per request until their next token is known, and computed into the head's cache
(no logits) once more than `EAGER_ROWS` wait, so a long prompt or a long pause in speculation never
holds more than that many rows of streams per request. At a draft, per request:

1. catch up: the positions up to the last known token's predecessor (their streams from the target;
   zeros for those the target never computed here: a prefix-cache hit), all requests in one forward
   (split at max_num_batched_tokens); the last row's argmax over the draft vocabulary, mapped through
   d2t, is the first draft;
2. k - 1 more steps, one forward for the whole batch each: token = the draft before, hidden = the head's
   own output before the final norm at the row before (EAGLE's recurrence), on the device.

Drafts are greedy (point mass): the verify step keeps the target's distribution as it is. What the head
computes past the known tokens (its own drafts) is never kept: the next draft recomputes from the target's
streams at the accepted positions, written over those slots. With a tensor-parallel target the head lives
on rank 0's device only, built and run inside single_rank (distributed/parallel_state.py) as at tensor
parallel 1, reading rank 0's copy of the streams (the residual stream is whole on every rank); a head
without its own embedding reads the target's whole from the target's weights there (the target's rows
are split over the ranks), refused when they have none (dummy weights). The head's steps run eagerly (one
host sync per draft, the tokens' copy).

The package: `checkpoint.py` reads and checks the released format before any weight loads, `head.py` is the
head as a torch module, `drafter.py` runs it (the target's streams, the head's sequences and forwards).
"""

from __future__ import annotations

from fitserve.spec_decode.eagle3.checkpoint import (
    Eagle3Checkpoint,
    check_eagle3_target,
    eagle3_kv_elements,
    read_eagle3_checkpoint,
)
from fitserve.spec_decode.eagle3.drafter import Eagle3Drafter

__all__ = [
    "Eagle3Checkpoint",
    "Eagle3Drafter",
    "check_eagle3_target",
    "eagle3_kv_elements",
    "read_eagle3_checkpoint",
]
