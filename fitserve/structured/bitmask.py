"""Applying token bitmasks to a batch's logits: the int32 words unpacked into a bool mask with tensor
ops (the same on CPU and CUDA; no kernel of the grammar package), then every disallowed token's
logit set to -inf, for the constrained rows only."""

from __future__ import annotations

import torch

_BYTE_BITS: dict[torch.device, torch.Tensor] = {}


def _byte_bits(device: torch.device) -> torch.Tensor:
    """bool [256, 8]: row b holds the bits of the byte b, lowest first."""
    table = _BYTE_BITS.get(device)
    if table is None:
        table = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool().to(device)
        _BYTE_BITS[device] = table
    return table


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [rows, words] (bit b of word w = token 32 * w + b) -> bool [rows, vocab_size], True where
    the token is allowed. Tokens past the words' 32 * words bits are not allowed.

    Each int32 word is read as its 4 bytes, lowest first (little-endian, as on x86, ARM and CUDA
    devices), and each byte looks up its 8 bits in a [256, 8] table: one byte of temporary memory per
    token (shifting the int32 words 32 ways would take four)."""
    rows, words = bitmask.shape
    as_bytes = bitmask.contiguous().view(torch.uint8).long()  # [rows, words * 4]
    allowed = _byte_bits(bitmask.device)[as_bytes].view(rows, words * 32)
    if words * 32 >= vocab_size:
        return allowed[:, :vocab_size]
    padding = torch.zeros((rows, vocab_size - words * 32), dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, padding], dim=1)


def apply_bitmask_rows(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: logits[rows[j], t] = -inf wherever bit t of bitmask[j] is 0. The bitmask may be on
    the host; it is copied to the logits' device first."""
    device = logits.device
    if bitmask.device != device:
        if device.type == "cuda":
            bitmask = bitmask.pin_memory()
        bitmask = bitmask.to(device, non_blocking=True)
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        logits.masked_fill_(~allowed, -torch.inf)
        return
    index = torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
    logits[index] = logits[index].masked_fill(~allowed, -torch.inf)
