"""A tensor-parallel rank's part of each int4 checkpoint tensor (layouts: int4_formats.py).

Output rows (column-parallel layers) are cut along each tensor's ParamSpec.shard_dim, 8 rows an int32
where they are packed along the rows. Input columns (row-parallel layers) are cut along `COLUMN_DIMS`:
8 columns an int32 for codes packed along the columns, one group a row of scales and zero points (a
per-channel layer's one group is kept whole: its scale applies to every rank's columns), one column an
element of g_idx, whose groups are renumbered from the rank's first.

GPTQ act order (g_idx) on a row-parallel layer: a rank's columns hold scattered groups, so every rank
keeps all the groups' scales and zero points while loading (`keeps_all_groups`); once its g_idx is in,
`act_order_groups` checks that each group it touches lies wholly in its columns and `select_groups` keeps
those groups, renumbered. Where a group spans ranks (as in most desc_act checkpoints) the layer is refused:
a rank's columns would need their own per-column groups, which no int4 path here runs.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from fitserve.layers.quantization.int4_formats import ParamSpec
from fitserve.layers.quantization.quant_config import Int4Format
from fitserve.layers.quantization.tp_split import RankSlice, check_columns_align, take_columns, take_rows

GROUP = 0  # COLUMN_DIMS: one element per quantization group
# layout -> tensor -> (the dim along which it stores input columns, columns an element: 8, 1 or GROUP)
COLUMN_DIMS: dict[str, dict[str, tuple[int, int]]] = {
    "gptq": {"qweight": (0, 8), "qzeros": (0, GROUP), "scales": (0, GROUP), "g_idx": (0, 1)},
    "awq": {"qweight": (0, 1), "qzeros": (0, GROUP), "scales": (0, GROUP)},
    "pack-quantized": {
        "weight_packed": (1, 8),
        "weight_scale": (1, GROUP),
        "weight_zero_point": (1, GROUP),
        "weight_g_idx": (0, 1),
    },
}


def keeps_all_groups(fmt: Int4Format, part: RankSlice) -> bool:
    """Whether this rank holds every group's scales and zero points: act order on a row-parallel layer."""
    return fmt.act_order and fmt.group_size != -1 and part.splits_columns


def check_rank_columns(fmt: Int4Format, part: RankSlice, what: str) -> None:
    """ValueError, before anything loads, when a row-parallel rank's columns would split an int32 of
    packed codes or (without act order) a group."""
    check_columns_align(part, 8, what, "an int32 of packed codes")
    if fmt.group_size != -1 and not fmt.act_order:
        check_columns_align(part, fmt.group_size, what, _group_unit(fmt))


def _group_unit(fmt: Int4Format) -> str:
    return f"a group (group_size {fmt.group_size})"


def rank_specs(fmt: Int4Format, specs: dict[str, ParamSpec], part: RankSlice) -> dict[str, ParamSpec]:
    """The rank's parameter specs (param_specs of its sizes), with every group kept where
    `keeps_all_groups`."""
    if not keeps_all_groups(fmt, part):
        return specs
    whole_groups = part.whole_columns // fmt.group_size
    kept = dict(specs)
    for name, (dim, per) in COLUMN_DIMS[fmt.layout].items():
        if per == GROUP and name in specs:
            shape = list(specs[name].shape)
            shape[dim] = whole_groups
            kept[name] = replace(specs[name], shape=tuple(shape))
    return kept


def rank_part(
    fmt: Int4Format, name: str, spec: ParamSpec, loaded: torch.Tensor, part: RankSlice, what: str
) -> torch.Tensor:
    """The rank's part of the whole checkpoint tensor `name` (weight_shape: all of it)."""
    if spec.shard_dim is not None:
        loaded = take_rows(loaded, spec.shard_dim, part, what, spec.rows_per)
    if name not in COLUMN_DIMS[fmt.layout] or not part.splits_columns:
        return loaded
    dim, per = COLUMN_DIMS[fmt.layout][name]
    if per == GROUP:
        if fmt.group_size == -1 or keeps_all_groups(fmt, part):
            return loaded
        return take_columns(loaded, dim, part, what, fmt.group_size, _group_unit(fmt))
    if per == 8:
        return take_columns(loaded, dim, part, what, 8, "an int32 of packed codes")
    if not name.endswith("g_idx"):
        return take_columns(loaded, dim, part, what)
    # g_idx: the rank's columns; renumbered from its first group unless act order keeps every group
    own = take_columns(loaded, dim, part, what)
    if fmt.group_size == -1 or keeps_all_groups(fmt, part):
        return own
    check_columns_align(part, fmt.group_size, what, _group_unit(fmt))
    return own - part.columns_start // fmt.group_size


def act_order_groups(g_idx: torch.Tensor, group_size: int, whole_groups: int, what: str) -> torch.Tensor:
    """The groups (ascending) a row-parallel rank's act-order columns hold, given their g_idx (the
    checkpoint's group numbers); ValueError when a group lies partly in another rank's columns."""
    g_idx = g_idx.to(torch.int64)
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= whole_groups:
        raise ValueError(
            f"{what}: g_idx values {int(g_idx.min())}..{int(g_idx.max())} are not groups of "
            f"0..{whole_groups - 1}: the checkpoint is damaged; download it again"
        )
    counts = torch.bincount(g_idx, minlength=whole_groups)
    held = counts.nonzero().squeeze(1)
    partial = held[counts[held] != group_size]
    if partial.numel():
        group = int(partial[0])
        raise ValueError(
            f"{what}: act order (desc_act / g_idx) on a row-parallel layer: this rank's {g_idx.numel()} "
            f"input columns hold {int(counts[group])} of group {group}'s {group_size} columns, the rest "
            "lie on other ranks; fitserve splits act-order layers across ranks only where every group lies "
            "within one rank's columns; run this checkpoint with --tensor-parallel-size 1, or use one "
            "quantized without act order (desc_act false)"
        )
    return held


def select_groups(
    fmt: Int4Format, tensors: dict[str, torch.Tensor], g_idx_name: str, groups: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The rank's tensors with only the groups `groups` (act_order_groups) kept and g_idx renumbered."""
    selected = dict(tensors)
    for name, (dim, per) in COLUMN_DIMS[fmt.layout].items():
        if per == GROUP and name in tensors:
            selected[name] = tensors[name].index_select(dim, groups)
    g_idx = tensors[g_idx_name].to(torch.int64)
    selected[g_idx_name] = torch.searchsorted(groups, g_idx).to(tensors[g_idx_name].dtype)
    return selected
