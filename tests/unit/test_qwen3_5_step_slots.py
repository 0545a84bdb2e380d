"""A step's recurrent-state slots as the Gated DeltaNet layers read them: split once per step into decode
rows and prompt pieces (layers/gated_delta_rule.py), uploaded with the step's inputs (worker/step_inputs.py),
the layer's batched path against the per-sequence ops, padded rows (slot -1) touching no state, the
prefix-cache snapshot copies made around the forward (ModelRunner._forward) equal to the layer's own, and
the CUDA graph runner's static slots buffer (worker/cuda_graphs.py; its staging runs on CPU tensors)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fitserve.core.state_slots import StepStateSlots
from fitserve.kv_layers import cuda_graphs_unsupported
from fitserve.layers.attention.metadata import AttentionMetadata, forward_context
from fitserve.layers.gated_delta_rule import (
    DeltaNetStepSlots,
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
    split_state_rows,
)
from fitserve.models.qwen3_5_delta_net import GatedDeltaNet
from fitserve.worker.cuda_graphs import CudaGraphRunner
from fitserve.worker.model_runner import ModelRunner
from fitserve.worker.recurrent_state import RecurrentStatePool, recurrent_state_layers
from fitserve.worker.step_inputs import HostInputs, StepInputs, _state_copies, upload_inputs
from fitserve.worker.transfer import PinnedStagingRing
from tests.unit.qwen3_5_helpers import make_config

SLOTS = 12
# a step of every kind: a decode row, a prompt's next chunk (from its state), a decode row, a fresh prompt,
# a one-token prompt (position 0: from zeros, so a prompt piece)
QUERY_LENS = [1, 5, 1, 7, 1]
SEQ_LENS = [9, 12, 4, 7, 1]
STEP_SLOTS = [3, 5, 8, 1, 2]


@pytest.fixture(scope="module")
def config():
    return make_config(moe=False, conditional=False)


def make_layer(config) -> tuple[GatedDeltaNet, RecurrentStatePool]:
    """A DeltaNet layer with O(1) random weights and decays in (0.3, 1), and a one-layer pool of random
    states (every slot distinct, so a wrong slot read shows)."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(config, 0)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name == "A_log":
                param.copy_(torch.rand(param.shape).log() - 1.0)
            elif name == "dt_bias":
                param.copy_(torch.randn(param.shape) * 0.3)
            elif name == "norm.weight":
                param.copy_(1.0 + 0.1 * torch.randn(param.shape))
            else:
                param.copy_(torch.randn(param.shape) / param.shape[-1] ** 0.5)
    shape = recurrent_state_layers(config)[0]
    pool = RecurrentStatePool((shape,), SLOTS, torch.float32, torch.device("cpu"))
    pool.conv[0].copy_(torch.randn(pool.conv[0].shape))
    pool.recurrent[0].copy_(torch.randn(pool.recurrent[0].shape) * 0.1)
    layer.conv_states, layer.recurrent_states = pool.conv[0], pool.recurrent[0]
    return layer, pool


def metadata_for(query_lens, seq_lens, slots, state_slots=None) -> AttentionMetadata:
    tokens, batch = sum(query_lens), len(query_lens)
    return AttentionMetadata(
        slot_mapping=torch.zeros(tokens, dtype=torch.int64),
        query_start_loc=torch.tensor(np.cumsum([0, *query_lens]), dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.zeros((batch, 1), dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        state_slots_cpu=slots,
        state_slots=state_slots,
    )


def run_layer(layer: GatedDeltaNet, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
    with torch.no_grad(), forward_context(metadata, []):
        return layer(hidden)


def per_sequence_reference(layer, hidden, query_lens, seq_lens, slots, conv, recurrent) -> torch.Tensor:
    """The layer as it ran before: each prompt piece alone through the chunked rule, each decode row
    through the one-token ops, states read from and written to conv / recurrent (copies of the pool)."""
    with torch.no_grad():
        qkv, z, b, a = layer.project(hidden)
        g, beta = layer._gates(a, b)
        outs, start = [], 0
        for query_len, seq_len, slot in zip(query_lens, seq_lens, slots):
            rows = slice(start, start + query_len)
            if query_len == 1 and seq_len > 1:
                mixed, new_conv = causal_conv1d_step(qkv[rows], layer.conv_weight, conv[[slot]])
                q, k, v = layer._heads(mixed)
                out, new_state = recurrent_gated_delta_rule(q, k, v, g[rows], beta[rows], recurrent[[slot]])
                conv[slot], recurrent[slot] = new_conv[0], new_state[0]
            else:
                fresh = seq_len == query_len
                mixed, new_conv = causal_conv1d(qkv[rows], layer.conv_weight, None if fresh else conv[slot])
                q, k, v = layer._heads(mixed)
                out, new_state = chunk_gated_delta_rule(
                    q, k, v, g[rows], beta[rows], None if fresh else recurrent[slot]
                )
                conv[slot], recurrent[slot] = new_conv, new_state
            outs.append(out)
            start += query_len
        core = torch.cat(outs)
        tokens = hidden.shape[0]
        core = layer.norm(core.to(hidden.dtype), z.reshape(tokens, layer.num_v_heads, -1))
        return layer.out_proj(core.reshape(tokens, layer.value_size))


def test_split_puts_each_sequence_in_its_kind():
    host = split_state_rows(QUERY_LENS, SEQ_LENS, STEP_SLOTS)
    assert host.decode_slots.tolist() == [3, 8] and host.decode_slots.dtype == np.int32
    assert host.decode_rows.tolist() == [0, 6]
    assert host.prefill_rows.tolist() == list(range(1, 6)) + list(range(7, 15))
    assert host.prefill_query_lens == [5, 7, 1]
    assert host.prefill_slots == [5, 1, 2]
    assert host.prefill_initial == [True, False, False]


def test_split_of_one_kind_needs_no_row_index():
    decode = split_state_rows([1, 1, 1], [5, 9, 2], [4, 6, 7])
    assert decode.decode_slots.tolist() == [4, 6, 7] and decode.decode_rows.size == 0
    assert decode.prefill_rows.size == 0 and not decode.prefill_query_lens
    step = DeltaNetStepSlots.build([1, 1, 1], [5, 9, 2], [4, 6, 7], torch.device("cpu"))
    assert step.is_decode_only and step.decode_rows is None and step.prefill_rows is None
    prompts = DeltaNetStepSlots.build([3, 4], [3, 10], [1, 2], torch.device("cpu"))
    assert prompts.decode_slots is None and prompts.prefill_rows is None
    assert not prompts.is_decode_only and prompts.prefill_initial == (False, True)


def test_mixed_step_matches_the_per_sequence_path(config):
    layer, pool = make_layer(config)
    conv, recurrent = pool.conv[0].clone(), pool.recurrent[0].clone()
    hidden = torch.randn(sum(QUERY_LENS), config.hidden_size)
    want = per_sequence_reference(layer, hidden, QUERY_LENS, SEQ_LENS, STEP_SLOTS, conv, recurrent)
    step = DeltaNetStepSlots.build(QUERY_LENS, SEQ_LENS, STEP_SLOTS, torch.device("cpu"))
    assert step.decode_rows is not None and step.prefill_rows is not None
    got = run_layer(layer, hidden, metadata_for(QUERY_LENS, SEQ_LENS, None, step))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool.conv[0], conv, rtol=0, atol=0)
    torch.testing.assert_close(pool.recurrent[0], recurrent, rtol=1e-6, atol=1e-7)
    # the fresh one-token prompt started from zeros, not from what its slot held
    fresh = per_sequence_reference(
        layer, hidden[-1:], [1], [1], [0], pool.conv[0].clone(), pool.recurrent[0].clone()
    )
    torch.testing.assert_close(got[-1:], fresh, rtol=1e-5, atol=1e-6)


def test_padded_rows_touch_no_state(config):
    layer, pool = make_layer(config)
    hidden = torch.randn(3, config.hidden_size)
    before_conv, before_recurrent = pool.conv[0].clone(), pool.recurrent[0].clone()
    padded = DeltaNetStepSlots.decode_only(torch.tensor([4, -1, 9], dtype=torch.int32))
    got = run_layer(layer, hidden, metadata_for([1] * 3, [6] * 3, None, padded))
    conv_after, recurrent_after = pool.conv[0].clone(), pool.recurrent[0].clone()
    changed = [s for s in range(SLOTS) if not torch.equal(conv_after[s], before_conv[s])]
    assert changed == [4, 9]
    assert [s for s in range(SLOTS) if not torch.equal(recurrent_after[s], before_recurrent[s])] == [4, 9]
    # the same two rows without the padded one: the same outputs and states
    pool.conv[0].copy_(before_conv)
    pool.recurrent[0].copy_(before_recurrent)
    real = DeltaNetStepSlots.decode_only(torch.tensor([4, 9], dtype=torch.int32))
    want = run_layer(layer, hidden[[0, 2]], metadata_for([1] * 2, [6] * 2, None, real))
    torch.testing.assert_close(got[[0, 2]], want, rtol=1e-6, atol=1e-7)
    assert torch.equal(pool.conv[0], conv_after) and torch.equal(pool.recurrent[0], recurrent_after)


def step_state_slots() -> StepStateSlots:
    slots = StepStateSlots(list(STEP_SLOTS))
    slots.restores = {1: 10}  # the prompt's next chunk resumes from a prefix-cache snapshot
    slots.saves = {1: 11, 2: 6}  # two rows end on a block boundary
    return slots


def host_inputs(slots: StepStateSlots) -> HostInputs:
    tokens, batch = sum(QUERY_LENS), len(QUERY_LENS)
    rows = split_state_rows(QUERY_LENS, SEQ_LENS, slots)
    arrays = [
        np.arange(tokens, dtype=np.int64),
        np.zeros(tokens, dtype=np.int64),
        np.zeros(tokens, dtype=np.int64),
        np.cumsum([0, *QUERY_LENS]).astype(np.int32),
        np.array(SEQ_LENS, dtype=np.int32),
        np.zeros((batch, 2), dtype=np.int32),
        np.zeros(0, dtype=np.int64),
        np.zeros(0, dtype=np.int64),
        np.zeros(0, dtype=np.int64),
        *rows.arrays(),
        *_state_copies(slots),
    ]
    return HostInputs(
        arrays=arrays,
        query_lens=list(QUERY_LENS),
        seq_lens=list(SEQ_LENS),
        num_samples=batch,
        samples_all_rows=False,
        prompt_logprob_rows={},
        has_fill=False,
        state_slots=slots,
        state_rows=rows,
    )


def test_upload_carries_the_split_and_the_snapshot_copies():
    inputs = upload_inputs(host_inputs(step_state_slots()), PinnedStagingRing(torch.device("cpu")), [0])
    step = inputs.metadata.state_slots
    assert step is not None and step.decode_slots is not None
    assert step.decode_slots.tolist() == [3, 8] and step.decode_rows.tolist() == [0, 6]
    assert step.prefill_query_lens == (5, 7, 1) and step.prefill_initial == (True, False, False)
    assert inputs.metadata.state_slots_cpu == STEP_SLOTS
    assert inputs.state_restores is not None and inputs.state_saves is not None
    assert [t.tolist() for t in inputs.state_restores] == [[10], [5]]
    assert [t.tolist() for t in inputs.state_saves] == [[5, 8], [11, 6]]
    assert inputs.sample_rows is not None and inputs.sample_rows.numel() == 0  # the base arrays intact
    none = StepStateSlots(list(STEP_SLOTS))
    plain = upload_inputs(host_inputs(none), PinnedStagingRing(torch.device("cpu")), [0])
    assert plain.state_restores is None and plain.state_saves is None


def test_copies_around_the_forward_equal_the_layers_own(config):
    """The runner's path (pool copies before and after, the layer on the uploaded slots) against a
    caller passing only host slots, whose snapshot copies the layer makes itself."""
    slots = step_state_slots()
    hidden = torch.randn(sum(QUERY_LENS), config.hidden_size)
    layer, pool = make_layer(config)
    own = run_layer(layer, hidden, metadata_for(QUERY_LENS, SEQ_LENS, slots))
    own_states = pool.conv[0].clone(), pool.recurrent[0].clone()

    layer, pool = make_layer(config)
    inputs = upload_inputs(host_inputs(slots), PinnedStagingRing(torch.device("cpu")), [0])
    runner = ModelRunner.__new__(ModelRunner)
    runner.graph_runner = runner.piecewise_runner = None
    runner.stage = None  # no pipeline stages
    runner.kv_caches = []
    calls = []

    class Model:
        def copy_states(self, sources, targets):
            calls.append(("copy", sources.tolist(), targets.tolist()))
            pool.copy_slots(sources, targets)

        def __call__(self, input_ids, positions):
            calls.append(("forward",))
            return layer(hidden)

    runner.model = Model()
    with torch.no_grad():
        got = runner._forward(inputs)
    assert calls == [("copy", [10], [5]), ("forward",), ("copy", [5, 8], [11, 6])]
    torch.testing.assert_close(got, own, rtol=0, atol=0)
    assert torch.equal(pool.conv[0], own_states[0]) and torch.equal(pool.recurrent[0], own_states[1])
    # the snapshot really moved: slot 11 holds slot 5's state after the step, not its own
    assert torch.equal(pool.recurrent[0][11], pool.recurrent[0][5])


def test_pool_copies_every_layer():
    shape = recurrent_state_layers(make_config(moe=False, conditional=False))[0]
    pool = RecurrentStatePool((shape, shape), 6, torch.float32, torch.device("cpu"))
    for tensor in (*pool.conv, *pool.recurrent):
        tensor.copy_(torch.randn(tensor.shape))
    before = [t.clone() for t in (*pool.conv, *pool.recurrent)]
    pool.copy_slots(torch.tensor([1, 4]), torch.tensor([4, 2]))  # 4 is read before it is written
    for tensor, old in zip((*pool.conv, *pool.recurrent), before):
        assert torch.equal(tensor[4], old[1]) and torch.equal(tensor[2], old[4])
        assert torch.equal(tensor[[0, 1, 3, 5]], old[[0, 1, 3, 5]])


def make_graph_runner(recurrent: bool) -> CudaGraphRunner:
    model = SimpleNamespace(has_recurrent_state=recurrent)
    return CudaGraphRunner(model, [], [1, 2, 4], 4, 64, 8, torch.float32, torch.device("cpu"))


def test_graph_runner_stages_slots_and_pads_with_minus_one():
    runner = make_graph_runner(recurrent=True)
    assert runner.state_slots is not None and runner.state_slots.tolist() == [-1] * 4
    captured = runner._metadata(4).state_slots
    assert captured is not None and captured.is_decode_only
    assert captured.decode_slots.data_ptr() == runner.state_slots.data_ptr()  # the graph reads the buffer
    full = DeltaNetStepSlots.decode_only(torch.tensor([5, 6, 7, 8], dtype=torch.int32))
    runner._copy_state_slots(metadata_for([1] * 4, [3] * 4, None, full), 4, 4)
    step = DeltaNetStepSlots.decode_only(torch.tensor([2, 9, 3], dtype=torch.int32))
    runner._copy_state_slots(metadata_for([1] * 3, [3] * 3, None, step), 3, 4)
    assert runner.state_slots.tolist() == [2, 9, 3, -1]  # the earlier step's slot 8 is gone
    mixed = DeltaNetStepSlots.build([1, 2], [5, 2], [1, 2], torch.device("cpu"))
    with pytest.raises(ValueError, match="decode-only step"):
        runner._copy_state_slots(metadata_for([1, 2], [5, 2], None, mixed), 2, 2)
    assert make_graph_runner(recurrent=False).state_slots is None
    assert make_graph_runner(recurrent=False)._metadata(2).state_slots is None


def test_model_runner_replays_only_decode_only_steps():
    """A one-token prompt (position 0) in a hybrid's step of one-token rows runs eagerly: the graphs
    only decode."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.piecewise_runner = None
    runner.stage = None  # no pipeline stages
    runner.kv_caches = []
    replayed = []
    runner.graph_runner = SimpleNamespace(
        can_run=lambda batch, max_query_len: max_query_len == 1,
        run=lambda *args: replayed.append(True) or torch.zeros(2, 1),
    )
    runner.model = lambda input_ids, positions: torch.ones(2, 1)
    for seq_lens, graph in (([5, 7], True), ([5, 1], False)):
        replayed.clear()
        step = DeltaNetStepSlots.build([1, 1], seq_lens, [1, 2], torch.device("cpu"))
        inputs = StepInputs(
            input_ids=torch.zeros(2, dtype=torch.long),
            positions=torch.zeros(2, dtype=torch.long),
            metadata=metadata_for([1, 1], seq_lens, None, step),
            sample_rows=None,
            num_samples=2,
            prompt_logprob_rows={},
        )
        out = runner._forward(inputs)
        assert bool(replayed) == graph and float(out[0, 0]) == (0.0 if graph else 1.0)


def test_qwen3_5_steps_are_captured():
    assert cuda_graphs_unsupported("qwen3_5") is None
    assert cuda_graphs_unsupported("qwen3_5_moe_text") is None


def test_the_plan_reserves_graph_memory_for_qwen3_6():
    """The planner reads the same list (kv_layers.cuda_graphs_unsupported): a Qwen3.6 plan on a GPU now
    captures decode steps and reserves their memory; --enforce-eager reserves none."""
    from fitserve.args import EngineArgs
    from fitserve.planner.fit import auto_fit
    from fitserve.planner.hardware import parse_assume_gpus
    from tests.unit.planner_helpers import H100, model_info

    info = model_info("qwen3.6-35b-a3b")
    # few sequences: the weights leave an H100 little room, where auto-fit would drop the graphs first
    args = EngineArgs(max_model_len=4096, max_num_seqs=16)
    graphs = auto_fit(info, args, parse_assume_gpus(H100), serving=True).plan
    assert graphs.inputs.cudagraph_capture_sizes and graphs.cuda_graph_gib > 0
    eager_args = EngineArgs(max_model_len=4096, max_num_seqs=16, enforce_eager=True)
    eager = auto_fit(info, eager_args, parse_assume_gpus(H100), serving=True).plan
    assert not eager.inputs.cudagraph_capture_sizes and eager.cuda_graph_gib == 0
