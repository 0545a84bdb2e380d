"""A step's inputs: built on the host from the scheduler's output (`HostInputs`, plain numbers and numpy
arrays, which is what travels to the other tensor-parallel ranks), then copied to the device in one
upload (`StepInputs`).

Contract (ModelRunner.launch): the tokens the scheduler listed, in its order; one sampled row per
request whose last known token is computed; prompt-logprob rows for the prompt positions computed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fitserve.core.scheduler import ScheduledRequest
from fitserve.core.state_slots import StepStateSlots, state_slots_of
from fitserve.layers.attention.metadata import AttentionMetadata
from fitserve.layers.gated_delta_rule import DeltaNetStepSlots, StateRowsHost, split_state_rows
from fitserve.models.delta_net_chain import ChainedStepSlots
from fitserve.worker.block_table_rows import BlockTableRows, extend_slots
from fitserve.worker.group_tables import GroupTables
from fitserve.worker.state_rings import StateRings, StepChain
from fitserve.worker.transfer import PinnedStagingRing

# The arrays every step uploads, in this order; a model with several KV cache groups appends two per
# extra group (slot mapping, block table), and a hybrid model NUM_STATE_ARRAYS after those.
NUM_STEP_ARRAYS = 9
# Hybrid models: the DeltaNet split (decode slots, decode rows, prompt rows: StateRowsHost.arrays) and the
# prefix-cache snapshot copies before and after the forward (each [sources..., targets...]); a verify
# step's chain after those (worker/state_rings.StepChain.arrays, HostInputs.state_chain).
NUM_STATE_ARRAYS = 5

# req_id -> (hidden rows, the prompt token each row predicts, how many top logprobs)
PromptLogprobRows = dict[str, tuple[list[int], list[int], int]]


@dataclass
class HostInputs:
    arrays: list[np.ndarray]
    query_lens: list[int]
    seq_lens: list[int]
    num_samples: int
    # Sampled rows are every row, in order (no index to upload).
    samples_all_rows: bool
    prompt_logprob_rows: PromptLogprobRows
    has_fill: bool
    # Hybrid models: each sequence's recurrent state slot (core/state_slots.py); None otherwise
    state_slots: list[int] | None = None
    # ... and their split into decode rows and prompt pieces (its arrays are among `arrays`)
    state_rows: StateRowsHost | None = None
    # Speculative decoding on a hybrid: a verify step's decode rows by chain depth, each depth's sizes
    # (rows, copies); their arrays and the chains' heads end `arrays` (worker/state_rings.py StepChain);
    # None: no verify rows
    state_chain: list[tuple[int, int]] | None = None


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    # Rows of the hidden states to sample from, one per sampling request; None when every row, in order.
    sample_rows: torch.Tensor | None
    num_samples: int
    prompt_logprob_rows: PromptLogprobRows
    # Tokens still in flight (-1 in input_ids): (rows, their indices among the last step's sampled ids)
    fill: tuple[torch.Tensor, torch.Tensor] | None = None
    # With several KV cache groups: each layer's metadata (ForwardContext.layer_metadata)
    layer_metadata: list[AttentionMetadata] | None = None
    # Hybrid models' prefix-cache snapshot copies, (source slots, target slots) int64 on the device: the
    # restores made before the forward, the saves after it (ModelRunner._forward); None: no copy
    state_restores: tuple[torch.Tensor, torch.Tensor] | None = None
    state_saves: tuple[torch.Tensor, torch.Tensor] | None = None


def build_host_inputs(
    scheduled: list[ScheduledRequest],
    block_size: int,
    table_rows_of: BlockTableRows,
    group_tables: GroupTables | None,
    in_flight_index: Callable[[str], int],
    state_rings: StateRings | None = None,
) -> tuple[HostInputs, list[ScheduledRequest]]:
    """The step's host inputs, and the requests that sample, in row order. state_rings: a hybrid model's
    pool rows under speculative decoding (worker/state_rings.py)."""
    one_token = all(item.num_new_tokens == 1 for item in scheduled)  # a decode step: the common case
    rows = _rows(scheduled, block_size, table_rows_of, in_flight_index, one_token)
    (
        input_ids,
        positions,
        slots,
        query_lens,
        seq_lens,
        block_tables,
        placeholder_rows,
        placeholder_sources,
        sample_indices,
        sample_items,
        prompt_rows,
    ) = rows
    all_rows = len(sample_indices) == len(input_ids)
    arrays = [
        np.array(input_ids, dtype=np.int64),
        positions,
        slots,
        np.cumsum([0, *query_lens], dtype=np.int32),
        np.array(seq_lens, dtype=np.int32),
        block_tables,
        np.array(placeholder_rows, dtype=np.int64),
        np.array(placeholder_sources, dtype=np.int64),
        np.array([] if all_rows else sample_indices, dtype=np.int64),
    ]
    if group_tables is not None:
        arrays.extend(group_tables.arrays(scheduled))
    state_slots = state_slots_of(scheduled)
    state_rows = None
    chain: StepChain | None = None
    if state_slots is not None:
        if state_rings is not None:  # live slots -> pool rows, a verify step's rows chained
            state_slots, chain = state_rings.place(scheduled, state_slots, query_lens, seq_lens)
        state_rows = split_state_rows(query_lens, seq_lens, state_slots)
        arrays.extend(state_rows.arrays())
        arrays.extend(_state_copies(state_slots))
        if chain is not None:
            arrays.extend(chain.arrays())
    host = HostInputs(
        arrays=arrays,
        query_lens=query_lens,
        seq_lens=seq_lens,
        num_samples=len(sample_items),
        samples_all_rows=all_rows,
        prompt_logprob_rows=prompt_rows,
        has_fill=bool(placeholder_rows),
        state_slots=state_slots,
        state_rows=state_rows,
        state_chain=chain.sizes if chain is not None else None,
    )
    return host, sample_items


def _rows(
    scheduled: list[ScheduledRequest],
    block_size: int,
    table_rows_of: BlockTableRows,
    in_flight_index: Callable[[str], int],
    one_token: bool = False,
) -> tuple:
    """Any step's rows: (input ids, positions, slots, query lens, seq lens, block tables, placeholder rows,
    their sources, sampled rows, sampled items, prompt-logprob rows). one_token: every row is one token (a
    decode step, or a verify step's rows): the cache slots then come from numpy over the persistent block
    table rows instead of one request at a time."""
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    sample_indices: list[int] = []
    sample_items: list[ScheduledRequest] = []
    # Rows whose token is still in flight, and where the last step's sampled ids hold it.
    placeholder_rows: list[int] = []
    placeholder_sources: list[int] = []
    prompt_rows: PromptLogprobRows = {}
    max_blocks = 0
    table_rows: list[int] = []
    row_of_request = table_rows_of.row
    for item in scheduled:
        request = item.request
        start, n = item.start, item.num_new_tokens
        row_offset = len(input_ids)
        table = item.block_ids
        known = request.all_token_ids
        if one_token:
            positions.append(start)  # its slot below, with every row's
        elif n == 1:
            positions.append(start)
            slots.append(table[start // bs] * bs + start % bs)
        else:
            positions.extend(range(start, start + n))
            extend_slots(slots, table, start, start + n, bs)
        if item.draft_token_ids and start >= len(known):  # a verify row (spec_decode/verify.py)
            input_ids.append(item.draft_token_ids[-1])
        elif start + n <= len(known):
            input_ids.extend(known[start : start + n])
        else:  # the last token is in flight: only ever one (see Scheduler)
            input_ids.extend(known[start:])
            input_ids.append(-1)  # written on the device from the last step's sampled ids
            placeholder_rows.append(len(input_ids) - 1)
            placeholder_sources.append(in_flight_index(request.request_id))
        table_rows.append(row_of_request(request.request_id, table))
        max_blocks = max(max_blocks, len(table))
        query_lens.append(n)
        seq_lens.append(start + n)
        if request.needs_prompt_logprobs and start < request.num_prompt_tokens - 1:
            _add_prompt_rows(prompt_rows, request, start, n, row_offset)
        if item.samples:
            sample_indices.append(row_offset + n - 1)
            sample_items.append(item)
    position_array = np.array(positions, dtype=np.int64)
    if one_token:
        blocks = table_rows_of.table[np.array(table_rows, dtype=np.int64), position_array // bs]
        slot_array = blocks.astype(np.int64) * bs + position_array % bs
    else:
        slot_array = np.array(slots, dtype=np.int64)
    return (
        input_ids,
        position_array,
        slot_array,
        query_lens,
        seq_lens,
        table_rows_of.gather(table_rows, max_blocks),
        placeholder_rows,
        placeholder_sources,
        sample_indices,
        sample_items,
        prompt_rows,
    )


def _add_prompt_rows(prompt_rows: PromptLogprobRows, request, start: int, n: int, row_offset: int) -> None:
    """The rows of a request's prompt positions computed this step: row j predicts token start + j + 1;
    those that are prompt tokens are kept."""
    last = min(start + n, request.num_prompt_tokens - 1)
    rows = list(range(row_offset, row_offset + last - start))
    next_ids = request.all_token_ids[start + 1 : last + 1]
    prompt_rows[request.request_id] = (rows, next_ids, request.params.prompt_logprobs)


def _state_copies(slots: StepStateSlots) -> list[np.ndarray]:
    """The step's copies before the forward (snapshot restores, snapshot -> the row's slot, and a verify
    step's accepted boundary states, pool row -> snapshot) and after it (saves, the row's slot ->
    snapshot), each as one int64 array [sources..., targets...]."""
    keeps = slots.keeps
    restores = [
        *slots.restores.values(),
        *(row for row, _ in keeps),
        *(slots[row] for row in slots.restores),
        *(snapshot for _, snapshot in keeps),
    ]
    saves = [*(slots[row] for row in slots.saves), *slots.saves.values()]
    return [np.array(restores, dtype=np.int64), np.array(saves, dtype=np.int64)]


def _copy_pairs(array: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An uploaded [sources..., targets...] array as (sources, targets) views; None when empty."""
    half = array.shape[0] // 2
    return (array[:half], array[half:]) if half else None


def upload_inputs(host: HostInputs, staging: PinnedStagingRing, layer_group: list[int]) -> StepInputs:
    """One host-to-device copy of the host inputs, and the attention metadata over them."""
    uploaded = staging.upload(host.arrays)
    (ids, pos, slot_mapping, starts, lens, tables, fill_rows, fill_sources, rows) = uploaded[:NUM_STEP_ARRAYS]
    state_slots = restores = saves = None
    if host.state_rows is not None:
        chain_arrays: list[torch.Tensor] = []
        if host.state_chain is not None:  # each depth's array, then the chains' heads
            chain_arrays = uploaded[len(uploaded) - len(host.state_chain) - 1 :]
            uploaded = uploaded[: len(uploaded) - len(host.state_chain) - 1]
        state_arrays = uploaded[len(uploaded) - NUM_STATE_ARRAYS :]
        uploaded = uploaded[: len(uploaded) - NUM_STATE_ARRAYS]
        if host.state_chain is None:
            state_slots = DeltaNetStepSlots.from_host(host.state_rows, state_arrays[:3])
        else:
            state_slots = ChainedStepSlots.from_uploaded(
                host.state_rows, state_arrays[:3], chain_arrays, host.state_chain
            )
        restores, saves = _copy_pairs(state_arrays[3]), _copy_pairs(state_arrays[4])
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=starts,
        seq_lens=lens,
        block_tables=tables,
        max_query_len=max(host.query_lens),
        max_seq_len=max(host.seq_lens),
        query_lens_cpu=host.query_lens,
        seq_lens_cpu=host.seq_lens,
        state_slots_cpu=host.state_slots,
        state_slots=state_slots,
    )
    layer_metadata = None
    if len(uploaded) > NUM_STEP_ARRAYS:
        group_metadata = [metadata]
        for i in range(NUM_STEP_ARRAYS, len(uploaded), 2):
            group_metadata.append(
                dataclasses.replace(metadata, slot_mapping=uploaded[i], block_tables=uploaded[i + 1])
            )
        layer_metadata = [group_metadata[group] for group in layer_group]
    return StepInputs(
        layer_metadata=layer_metadata,
        input_ids=ids,
        positions=pos,
        metadata=metadata,
        sample_rows=None if host.samples_all_rows else rows,
        num_samples=host.num_samples,
        prompt_logprob_rows=host.prompt_logprob_rows,
        fill=(fill_rows, fill_sources) if host.has_fill else None,
        state_restores=restores,
        state_saves=saves,
    )
