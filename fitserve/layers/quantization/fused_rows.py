"""A quantized checkpoint tensor that stores a packed layer's projections as one matrix (Qwen3.5's
in_proj_qkv: its q, k and v rows in one tensor), cut into each projection's tensor.

Under tensor parallel a quantized method takes a rank's rows one projection (shard) at a time
(tp_split.rank_slice refuses a whole fused tensor), and a rank's rows of a packed layer are each shard's
rows, not one run of the matrix. `fused_rows_pieces` gives each shard's part of a whole tensor, cut where
the format stores output rows:
- int4 (int4_formats.ParamSpec): along `shard_dim`, `rows_per` rows an element (AWQ's 8 rows an int32);
  g_idx is the same for every shard; weight_shape becomes the shard's [rows, K];
- fp8: the weight and a per-channel scale along dim 0, block scales by whole blocks of rows, a per-tensor
  scale and a static input scale the same for every shard;
- bitsandbytes while loading (--quantization bitsandbytes): the 16-bit weight along dim 0. A pre-quantized
  bitsandbytes checkpoint's flattened codes and quant_state hold the whole matrix's shape: refused.
Each shard's boundaries must fall on an element of the packed dim (named in the refusal).
"""

from __future__ import annotations

from typing import Any

import torch

from fitserve.layers.quantization.bnb_method import BnbLinearMethod
from fitserve.layers.quantization.fp8_method import Fp8LinearMethod
from fitserve.layers.quantization.int4_method import Int4LinearMethod


def fused_rows_pieces(layer: Any, name: str, tensor: torch.Tensor) -> list[tuple[Any, torch.Tensor]]:
    """[(shard id, the shard's part of `tensor`)] for checkpoint tensor `name` (a parameter name of the
    layer's method: weight_packed, qweight, weight_scale, ...) holding all of `layer`'s shards (its
    `full_shard_offsets`); ValueError naming the tensor and the fix where it cannot be cut."""
    method = layer.linear_method
    offsets: dict[Any, tuple[int, int]] = layer.full_shard_offsets
    what = f"{method.prefix}.{name}"
    dim, per = 0, 1
    if name == "bias":
        pass
    elif isinstance(method, Int4LinearMethod):
        if name == "weight_shape":
            columns = int(tensor[1])
            return [
                (shard, torch.tensor([rows, columns], dtype=tensor.dtype))
                for shard, (_, rows) in offsets.items()
            ]
        spec = method.specs[name]
        if spec.shard_dim is None:
            return [(shard, tensor) for shard in offsets]
        dim, per = spec.shard_dim, spec.rows_per
    elif isinstance(method, Fp8LinearMethod):
        if name == "input_scale" or (name != "weight" and tensor.numel() == 1):
            return [(shard, tensor) for shard in offsets]  # one value for the whole matrix
        if name != "weight" and method.fmt.strategy == "block" and method.fmt.block:
            per = method.fmt.block[0]
    elif isinstance(method, BnbLinearMethod) and method.fmt.prequantized:
        raise ValueError(
            f"{what}: a pre-quantized bitsandbytes checkpoint stores this layer's {len(offsets)} projections "
            f"({', '.join(map(str, offsets))}) as one flattened 4-bit matrix, which fitserve does not split "
            "across tensor-parallel ranks; run it with --tensor-parallel-size 1, or serve the 16-bit "
            "checkpoint with --quantization bitsandbytes"
        )
    pieces = []
    for shard, (start, rows) in offsets.items():
        if start % per or rows % per:
            raise ValueError(
                f"{what}: shard {shard!r} holds rows [{start}, {start + rows}) of the fused matrix, but the "
                f"checkpoint stores {per} rows an element: the shards cannot be cut apart for "
                "tensor parallel; run it with --tensor-parallel-size 1"
            )
        if (start + rows) // per > tensor.shape[dim]:
            raise ValueError(
                f"quantized tensor {what} has shape {tuple(tensor.shape)}: too small along dim {dim} for "
                f"the layer's {sum(size for _, size in offsets.values())} rows; the checkpoint is truncated "
                "or does not match config.json"
            )
        pieces.append((shard, tensor.narrow(dim, start // per, rows // per)))
    return pieces
