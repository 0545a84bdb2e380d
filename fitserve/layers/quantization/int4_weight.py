"""The one int4 form every int4 checkpoint format (GPTQ, AWQ, compressed-tensors, AutoRound) becomes at load.

    w[n, k] = (codes[n, j] - zeros[n, j // group_size]) * scales[n, j // group_size],  k = perm[j]

`codes` holds one unsigned 4-bit code (0..15) per byte, unpacked, in the computing column order: the
original order, or for GPTQ act-order (desc_act / g_idx) the order `perm` that makes each group's columns
contiguous; a layer then computes x[:, perm] @ (that matrix)^T. `zeros` is the code zero point z
(symmetric formats: 8). `dequantize` gives the float32 weight in the ORIGINAL column order: the reference
the loaders, the CPU forms and the GPU kernel are tested against.

`random_int4_weight` draws one for --load-format dummy: uniform codes, zero point 8 (symmetric) or a random
code near the codes' mean (asymmetric), scales around the one that gives the dequantized weight a chosen
standard deviation (initialize_dummy_weights' 0.02), no act order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Int4Weight:
    codes: torch.Tensor  # uint8 [N, K], 0..15, columns in computing order
    scales: torch.Tensor  # float [N, K // group_size] (float32 or the checkpoint's float dtype)
    zeros: torch.Tensor  # float32 [N, K // group_size]: the code of w = 0
    group_size: int  # K for per-channel
    perm: torch.Tensor | None = None  # int64 [K]: computing column j is original column perm[j]

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    def to(self, device: torch.device) -> Int4Weight:
        perm = None if self.perm is None else self.perm.to(device)
        return Int4Weight(
            self.codes.to(device), self.scales.to(device), self.zeros.to(device), self.group_size, perm
        )

    def check(self) -> None:
        """ValueError naming the field whose shape or dtype does not fit the others."""
        rows, cols = self.codes.shape
        if self.codes.dtype != torch.uint8:
            raise ValueError(f"Int4Weight.codes must be uint8, got {self.codes.dtype}")
        if self.group_size <= 0 or cols % self.group_size:
            raise ValueError(f"Int4Weight.group_size {self.group_size} does not divide K={cols}")
        groups = (rows, cols // self.group_size)
        for name in ("scales", "zeros"):
            if tuple(getattr(self, name).shape) != groups:
                raise ValueError(
                    f"Int4Weight.{name} has shape {tuple(getattr(self, name).shape)}, not {groups}"
                )
        if self.perm is not None and tuple(self.perm.shape) != (cols,):
            raise ValueError(f"Int4Weight.perm has shape {tuple(self.perm.shape)}, not ({cols},)")


def dequantize_in_computing_order(weight: Int4Weight) -> torch.Tensor:
    """float32 [N, K] with columns in `codes`' order (perm applied)."""
    rows, cols = weight.codes.shape
    groups = cols // weight.group_size
    codes = weight.codes.float().view(rows, groups, weight.group_size)
    values = (codes - weight.zeros.float()[..., None]) * weight.scales.float()[..., None]
    return values.view(rows, cols)


def dequantize(weight: Int4Weight) -> torch.Tensor:
    """The float32 weight [N, K] in the original column order."""
    values = dequantize_in_computing_order(weight)
    if weight.perm is None:
        return values
    original = torch.empty_like(values)
    original[:, weight.perm] = values
    return original


# E[(q - z)^2] for codes q uniform on 0..15 (variance 255/12, mean 7.5): z = 8, or z uniform on
# 4..11 (_DUMMY_ZEROS, variance 63/12, mean 7.5, so no group is biased on average).
_DUMMY_ZEROS = (4, 12)
_DUMMY_SQUARE = {True: 255 / 12 + 0.25, False: 255 / 12 + 63 / 12}


def random_int4_weight(
    out_features: int,
    in_features: int,
    group_size: int,
    symmetric: bool,
    std: float,
    generator: torch.Generator,
    device: torch.device | str | None = None,
) -> Int4Weight:
    """A random Int4Weight [N, K] on `device` (the generator's): codes uniform on 0..15, zeros 8 when
    `symmetric` else uniform integers 4..11, float32 scales uniform on [0.75, 1.25] times the one that makes
    the dequantized weight's standard deviation about `std`; perm None. Reproducible for a generator state."""
    groups = (out_features, in_features // group_size)
    codes = torch.randint(
        0, 16, (out_features, in_features), dtype=torch.uint8, generator=generator, device=device
    )
    if symmetric:
        zeros = torch.full(groups, 8.0, device=device)
    else:
        zeros = torch.randint(*_DUMMY_ZEROS, groups, generator=generator, device=device).float()
    base = std / _DUMMY_SQUARE[symmetric] ** 0.5
    scales = (torch.rand(groups, generator=generator, device=device) * 0.5 + 0.75) * base
    weight = Int4Weight(codes, scales, zeros, group_size)
    weight.check()
    return weight


def act_order_from_g_idx(g_idx: torch.Tensor, group_size: int, name: str) -> torch.Tensor | None:
    """The column order that makes a GPTQ g_idx's groups contiguous, or None when they already are
    (g_idx[k] == k // group_size). ValueError when a group does not hold exactly `group_size` columns."""
    in_features = g_idx.numel()
    g_idx = g_idx.to(torch.int64)
    if torch.equal(g_idx, torch.arange(in_features) // group_size):
        return None
    groups = in_features // group_size
    counts = torch.bincount(g_idx.clamp(0, groups), minlength=groups + 1)
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups or not bool((counts[:groups] == group_size).all()):
        raise ValueError(
            f"{name}: g_idx does not assign exactly {group_size} columns to each of {groups} groups "
            f"(values {int(g_idx.min())}..{int(g_idx.max())}): the checkpoint is damaged; download it again"
        )
    return torch.argsort(g_idx, stable=True)
