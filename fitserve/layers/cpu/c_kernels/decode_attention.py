"""Python side of decode_attention.c: which calls it takes, the ctypes call, and the post-build check."""

from __future__ import annotations

import ctypes

import torch

MAX_GROUP = 16  # query heads per key/value head (decode_attention.c's MAX_GROUP)


class DecodeAttention:
    """`fs_paged_decode_attention` of the built library (see decode_attention.c)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.fs_paged_decode_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        function.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, ptr, ptr, i64, ptr]
        function.argtypes += [i64, i64, i64, i64, ctypes.c_float, ptr, ctypes.c_int]
        function.restype = ctypes.c_int
        self._function = function

    @staticmethod
    def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """q [B, H, D], k and v [B, KVH, D] float32 on the CPU, heads and dims contiguous within a token;
        a contiguous float32 cache; D a multiple of 16; at most MAX_GROUP query heads per KV head."""
        if kv_cache.dtype != torch.float32 or kv_cache.is_cuda or not kv_cache.is_contiguous():
            return False
        num_heads, head_dim = q.shape[1:]
        num_kv_heads = k.shape[1]
        if head_dim % 16 or num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
            return False
        return all(
            t.dtype == torch.float32 and t.stride(2) == 1 and t.stride(1) == head_dim for t in (q, k, v)
        )

    def bind(
        self,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        q_shape: torch.Size,
        cache_shape: torch.Size,
    ) -> BoundDecodeAttention:
        """The call for one step's metadata, whose arguments are the same for every layer: made once per
        step, it leaves each layer's call only its own tensors to pass."""
        return BoundDecodeAttention(
            self._function, slot_mapping, block_tables, seq_lens, q_shape, cache_shape
        )

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Writes k, v at `slot_mapping` (int64 [B]) in kv_cache [2, blocks, block_size, KVH, D], then
        returns each query's attention over its sequence's first seq_lens[b] tokens (int32 [B], the new
        one included), found through block_tables (int32 [B, max_blocks]): float32 [B, H, D]."""
        bound = self.bind(slot_mapping, block_tables, seq_lens, q.shape, kv_cache.shape)
        out = bound(q, k, v, kv_cache, scale)
        assert out is not None
        return out

    def self_check(self) -> str | None:
        """Two sequences on scattered blocks against softmax(q k^T) v in torch, or what is wrong."""
        generator = torch.Generator().manual_seed(0)
        block_size, num_kv_heads, group, head_dim = 4, 2, 3, 32
        kv_cache = torch.randn(2, 8, block_size, num_kv_heads, head_dim, generator=generator)
        seq_lens = torch.tensor([7, 3], dtype=torch.int32)
        block_tables = torch.tensor([[5, 2], [7, 0]], dtype=torch.int32)
        slots = torch.tensor([2 * block_size + 2, 7 * block_size + 2])  # each sequence's last token
        q = torch.randn(2, num_kv_heads * group, head_dim, generator=generator)
        k = torch.randn(2, num_kv_heads, head_dim, generator=generator)
        v = torch.randn(2, num_kv_heads, head_dim, generator=generator)
        got = self(q, k, v, kv_cache, slots, block_tables, seq_lens, 0.2)
        flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
        for b, length in enumerate(seq_lens.tolist()):
            positions = torch.arange(length)
            rows = block_tables[b, positions // block_size].long() * block_size + positions % block_size
            keys = flat[0, rows].repeat_interleave(group, dim=1)  # [len, heads, dim]
            values = flat[1, rows].repeat_interleave(group, dim=1)
            weights = torch.softmax(torch.einsum("hd,thd->ht", q[b], keys) * 0.2, dim=-1)
            want = torch.einsum("ht,thd->hd", weights, values)
            if not torch.allclose(got[b], want, atol=1e-5, rtol=1e-4):
                error = float((got[b] - want).abs().max())
                return f"the built decode attention is off by {error:.3g} on a self-check"
        if not (torch.equal(flat[0, slots], k) and torch.equal(flat[1, slots], v)):
            return "the built decode attention did not store the new keys and values at their slots"
        return None


class BoundDecodeAttention:
    """`DecodeAttention` for one step: the step's slots, block tables and lengths (int64 / int32 copies
    kept alive here) and the shapes every layer shares."""

    def __init__(
        self,
        function: ctypes._CFuncPtr,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        q_shape: torch.Size,
        cache_shape: torch.Size,
    ) -> None:
        self._function = function
        self._tensors = (
            slot_mapping.to(torch.int64).contiguous(),
            block_tables.to(torch.int32).contiguous(),
            seq_lens.to(torch.int32).contiguous(),
        )
        slots, tables, lengths = self._tensors
        self.q_shape, self.cache_shape = q_shape, cache_shape
        batch, num_heads, head_dim = q_shape
        _, num_blocks, block_size, num_kv_heads, _ = cache_shape
        self._cache_args = (num_blocks, block_size, slots.data_ptr(), tables.data_ptr(), tables.shape[1])
        self._shape_args = (lengths.data_ptr(), batch, num_heads, num_kv_heads, head_dim)
        self._threads = torch.get_num_threads()
        self._max_len = int(lengths.max()) if batch else 0

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float
    ) -> torch.Tensor | None:
        """The layer's attention output [B, H, D], or None when its tensors are not shaped as bound or
        its cache is not float32 (the caller then takes another path). q, k and v: as `supports` takes
        them (every layer of a model hands them alike)."""
        if q.shape != self.q_shape or kv_cache.shape != self.cache_shape or kv_cache.dtype != torch.float32:
            return None
        out = torch.empty(self.q_shape)
        status = self._function(
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            kv_cache.data_ptr(),
            *self._cache_args,
            *self._shape_args,
            scale,
            out.data_ptr(),
            self._threads,
        )
        if status != 0:
            raise MemoryError(f"decode attention: no memory for the scores of {self._max_len} tokens")
        return out
