"""y = x @ W.T (+ bias) for a weight W stored as 4-bit codes (W4A16): one kernel family for every int4
format (AWQ, GPTQ, compressed-tensors, AutoRound), which the loader repacks once into the layout of
kernels/int4_repack.py (`repack_int4`: int32 words of 8 codes, 256 codes = 128 bytes per weight row per
block, nibble j of the block's 32 words = its 32 consecutive codes 32 j .. 32 j + 31; per group and
weight row a (scale, zero point) pair in the activation dtype). This module is the host side: the
launch configurations, their choice and `int4_linear`, which launches the kernels.

Three kernels, picked by the number of rows M of x (`choose_config`, a deterministic rule of M, N, K and
the GPU's SM count: no autotuning at run time, since fitserve captures CUDA graphs):

- `_int4_mma_gemv_kernel` (kernels/int4_mma_gemv.py, Gluon), M <= MMA_MAX_ROWS on SM 8.0+ with zero
  points the packed pairs keep exact (`mma_kernel_ok`): tensor cores fed from registers, x's rows the
  MMA's 8 columns. Against the two below at 1 to 8 rows (H100, Llama-3.1-8B's four layers): 56.8 against
  61.4 us at 1 row, 57.9 against 73.2 at 4 (benchmarks/results/h100_int4_mma_gemv.json).
- `_int4_gemv_kernel` (kernels/int4_gemv_kernel.py), M <= GEMV_MAX_ROWS (batch-1 decode) where the
  first cannot run: CUDA cores, ~4.4 instructions per weight in its loop (its docstring says how).
- `_int4_dot_kernel` (kernels/int4_dot_kernel.py), more rows:
  tensor cores on [BLOCK_M, BLOCK_N] output tiles, the weights dequantized in packed 16-bit pairs on
  GPUs (PAIRED, kernels/int4_pair_dequant.py), through float32 otherwise; SWAP_AB, WIDE_K and GROUP_M
  shape its tiles.
  Pairing halved the time of a Llama-3.1-8B layer at 4 to 128 rows on an H200 and the batch-64 decode
  step went from 12.1 to 5.2 ms, bf16's being 5.1 (benchmarks/results/h200_int4_paired_sweep.json,
  h200_quant_paired.json); choose_config's tiles come from that sweep (benchmarks/gpu/int4_paired_sweep.py).

Split-K without a second kernel and deterministic (kernels/int4_kernel_parts.py `_finish`: the last
program of a tile sums the splits' partials from a workspace [splits, M, N], counted in
`PackedInt4.counters`). Nothing is synchronised with the host and the only allocations are torch.empty
of y and of the workspace, so calls can be captured in CUDA graphs (one layer's calls must not run
concurrently on two streams: they share its counters).
All three launch with programmatic dependent launch on SM 9.0+ (kernels/dependent_launch.py).

What the lead should sweep on the H100 (benchmarks/gpu/int4_gemm.py --sweep times these per shape):
- GEMV (1 row; 2 to 4 rows against the dot kernel): BLOCK_N 16 / 32 / 64 / 128, num_warps 1 / 2 / 4 /
  8, num_stages 2 / 3 / 4, split_k (auto from GEMV_PROGRAMS_PER_SM, MIN_BLOCKS_PER_SPLIT), and
  GEMV_MAX_ROWS.
- dot, 2 to 128 rows: BLOCK_N 64 / 128, SWAP_AB and WIDE_K on / off, num_warps 4 / 8, num_stages 2 to
  5, split_k (DOT_PROGRAMS_PER_SM), PAIRED on / off (benchmarks/gpu/int4_paired_sweep.py).
- dot, more rows: BLOCK_M 64 / 128, BLOCK_N 64 / 128 / 256, num_warps 4 / 8, num_stages 2 / 3 (x's
  [BLOCK_M, 256] tile is BLOCK_M / 2 KB a stage: 128 x 128 with 3 stages needs 232 KB, more than the
  227 KB a program may have, and raises OutOfResources), WIDE_K, SWAP_AB, GROUP_M (the L2 swizzle of
  tiles).

Reference: `int4_repack.dequantize_reference`, then x.float() @ W.T. Imports triton: CUDA code paths
only (kernels/__init__.py). Under TRITON_INTERPRET=1 it also runs on CPU tensors (slowly), which
tests/unit/test_int4_gemm_interpret.py uses.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from fitserve.kernels.capability import (
    DEFAULT_SM_COUNT,
    SHARED_MEMORY_PER_BLOCK,
    kernel_capability,
    shared_memory_per_block,
    sm_count,
)
from fitserve.kernels.dependent_launch import pdl_kwargs
from fitserve.kernels.fast_launch import INTERPRETING
from fitserve.kernels.grid_math import cdiv, even_splits, next_power_of_2
from fitserve.kernels.int4_dot_kernel import _int4_dot_kernel
from fitserve.kernels.int4_gemv_kernel import _int4_gemv_kernel
from fitserve.kernels.int4_repack import (
    BLOCK_K,
    MAX_PAIRED_ZERO,
    MAX_SPLIT_ROW_TILES,
    MIN_BLOCK_N,
    PackedInt4,
)

try:
    from fitserve.kernels.int4_mma_gemv import _int4_mma_gemv_kernel
except ImportError:  # a Triton without Gluon's mma_v2 (before 3.6): the other kernels take every row count
    _int4_mma_gemv_kernel = None

# Rows of x the CUDA-core kernel takes by default. Per 4-bit weight its loop is ~4.5 instructions at one
# row (SASS of the sm_90 build), ~7.5 at two and ~10.6 at four, against ~6 for the tensor-core kernel
# at any row count up to 64: past one row the tensor cores win.
GEMV_MAX_ROWS = 1
# Up to this many rows, on SM 8.0+ with packed-pair zero points, the tensor-core kernel with the weights in
# registers (kernels/int4_mma_gemv.py: ~3 instructions a weight at one row against the CUDA-core
# kernel's ~4.4). Its 16-column form (9 to 16 rows) needs more registers than its 8-column one and
# measured slower than the tl.dot kernel (benchmarks/results/h100_int4_mma_gemv.json). MMA_DECODE False
# sends every row count to the other kernels (for comparisons).
MMA_MAX_ROWS = 8
MMA_DECODE = True
MMA_PROGRAMS_PER_SM = 4
SPLIT_MAX_ROWS = 64  # split-K only up to this many rows (past it the tiles fill the GPU)
# Split K into at most as many splits as keep the batch-1 grid within this many programs per SM, and
# only into splits of about equal length (a short last split idles the SMs that hold the others). The
# H200 and H100 sweeps (Llama-3.1-8B and 3.3-70B layers: benchmarks/results/h200_batch1_split_sweep.json,
# h100_batch1_split_sweep.json) are fastest at or just under 4 programs an SM, though 168 registers a
# thread (2 warps, 3 stages, sm_90 build) would let 6 be resident: past 4, each program's share of the
# SM's issue slots, not the grid's size, sets the time (capping registers to fit more measured slower:
# h100_int4_maxnreg_trial.json).
GEMV_PROGRAMS_PER_SM = 4
DOT_PROGRAMS_PER_SM = 2
# The same rule (DOT_PROGRAMS_PER_SM, equal parts) for the tensor-core kernel up to this many rows, which
# its 16-row tile holds (H100, 4 and 16 rows: Llama-3.3-70B's four layers 260.8 -> 225.7 us at 4 rows,
# 270.4 -> 235.7 at 16; Llama-3.1-8B 76.4 -> 73.6 and 83.2 -> 79.9: h100_int4_small_batch_splits.json);
# past it the round-up rule, not swept.
EVEN_SPLIT_MAX_ROWS = 16
PROGRAMS_PER_SM = {"gemv": GEMV_PROGRAMS_PER_SM, "mma": MMA_PROGRAMS_PER_SM, "dot": DOT_PROGRAMS_PER_SM}
MIN_BLOCKS_PER_SPLIT = 2  # a split streams at least 2 x 256 codes per weight row
MAX_SPLITS = 16
# Bytes of each of its weight rows (1,024 codes, the weights of skinny_gemm's 2 KB of bf16) a program
# of a streaming call asks the L2 for before waiting for the previous kernel (0: off).
PREFETCH_ROW_BYTES = 512
# float32 bits of 2**23: OR-ed over a code held in the low mantissa bits gives 2**23 + code, exactly.
MAGIC = 0x4B000000


@dataclass(frozen=True)
class Int4GemmConfig:
    """One launch configuration. split_k None: chosen from the grid and the SM count (choose_config)."""

    kernel: str  # "gemv", "dot" or "mma" (kernels/int4_mma_gemv.py: block_n = 16 num_warps row tiles)
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int | None = None
    swap_ab: bool = False  # dot only
    wide_k: bool = False  # dot only: one tl.dot of depth 256 per block instead of 8 of depth 32
    group_m: int = 8  # dot only: row tiles per L2 swizzle group
    paired: bool = True  # dot only: packed-pair dequantization where paired_dequant_ok (else float32)
    maxnreg: int | None = None  # registers a thread may use (None: ptxas decides)


def dot_shared_bytes(config: Int4GemmConfig) -> int:
    """About the shared memory a dot config asks for (sm_80+, where stages are cp.async buffers):
    num_stages - 1 buffers of x's [BLOCK_M, 256] tile (16-bit) and the words' [BLOCK_N, 32] (int32),
    WIDE_K's [BLOCK_N, 256] weight tile, 4 KB besides (sm_86 build: 64 x 64, 4 stages, 124 KB)."""
    stage = config.block_m * BLOCK_K * 2 + config.block_n * 32 * 4
    wide = config.block_n * BLOCK_K * 2 if config.wide_k else 0
    return (config.num_stages - 1) * stage + wide + 4096


def fit_shared_memory(config: Int4GemmConfig, shared_memory: int) -> Int4GemmConfig:
    """`config` with fewer stages (down to 2), then a smaller tile, then without WIDE_K's weight tile,
    until dot_shared_bytes fits a block's `shared_memory` (kernels/capability.py): the H100's configs as
    chosen, smaller GPUs' cut down (tests/unit/test_kernel_targets.py compiles them for each)."""
    if config.kernel != "dot":
        return config
    while dot_shared_bytes(config) > shared_memory:
        if config.num_stages > 2:
            config = replace(config, num_stages=config.num_stages - 1)
        elif config.block_m > 64:
            config = replace(config, block_m=config.block_m // 2, num_warps=4)
        elif config.block_n > 64:
            config = replace(config, block_n=config.block_n // 2)
        elif config.wide_k:
            config = replace(config, wide_k=False)
        else:
            break
    return config


def choose_config(
    rows: int,
    out_features: int,
    in_features: int,
    sms: int = DEFAULT_SM_COUNT,
    shared_memory: int = SHARED_MEMORY_PER_BLOCK[(9, 0)],
    mma: bool = False,
) -> Int4GemmConfig:
    """The launch configuration for x [rows, K] @ W[N, K].T: a fixed rule (no autotuning), split-K
    resolved. First guesses, to be swept on an H100 (module docstring); on GPUs whose blocks may have
    less shared memory than `shared_memory` (the H100's), cut down by fit_shared_memory. `mma`: the
    register-fed tensor-core kernel may run (`mma_kernel_ok`)."""
    if mma and rows <= MMA_MAX_ROWS:
        config = Int4GemmConfig("mma", block_m=8, block_n=64, num_warps=4)
    elif rows <= GEMV_MAX_ROWS:
        # 64 weight rows over 2 warps: 8 rows a thread, over which each x value's widening is shared; 3
        # stages keep two blocks of words in flight. At every K (the tensor-core kernel's 17.3 us for the
        # 8B's down projection against 15.3; the 70B's, 75.4 against 48.2: h200_batch1_split_sweep.json)
        config = Int4GemmConfig("gemv", block_m=next_power_of_2(rows), block_n=64, num_warps=2, num_stages=3)
    elif rows <= 16:
        # the weight on the MMA's long side, x's rows padded to 16 (H200 sweep: int4_paired_sweep.py)
        config = Int4GemmConfig("dot", block_m=16, block_n=128, num_warps=4, num_stages=4, swap_ab=True)
    elif rows <= SPLIT_MAX_ROWS:
        block_m = next_power_of_2(rows)
        config = Int4GemmConfig("dot", block_m=block_m, block_n=128, num_warps=8, num_stages=2, swap_ab=True)
    elif rows <= 128:  # H200 sweep: 240 us for the four Llama-3.1-8B layers at 128 rows, 344 the next rule
        config = Int4GemmConfig(
            "dot", block_m=128, block_n=64, num_warps=4, num_stages=3, swap_ab=True, wide_k=True
        )
    elif rows <= 256:  # shared memory per stage: x [BLOCK_M, 256] and words [BLOCK_N, 32] (227 KB at most)
        config = Int4GemmConfig("dot", block_m=64, block_n=128, num_warps=4, num_stages=3, wide_k=True)
    else:
        config = Int4GemmConfig("dot", block_m=128, block_n=128, num_warps=8, num_stages=2, wide_k=True)
    config = fit_shared_memory(config, shared_memory)
    return resolve_split(config, rows, out_features, in_features, sms)


def resolve_split(
    config: Int4GemmConfig, rows: int, out_features: int, in_features: int, sms: int
) -> Int4GemmConfig:
    """config with split_k set: as given (at most one split per 256-code block), else from the grid."""
    blocks = cdiv(in_features, BLOCK_K)
    tiles = cdiv(rows, config.block_m) * cdiv(out_features, config.block_n)
    if config.split_k is not None:
        splits = max(1, min(config.split_k, blocks))
    elif rows > SPLIT_MAX_ROWS or tiles > _counter_slots(out_features):
        splits = 1
    elif config.kernel != "dot" or rows <= EVEN_SPLIT_MAX_ROWS:
        per_sm = PROGRAMS_PER_SM[config.kernel]
        splits = even_splits(blocks, min(per_sm * sms // tiles, MAX_SPLITS), MIN_BLOCKS_PER_SPLIT)
    else:
        splits = cdiv(DOT_PROGRAMS_PER_SM * sms, tiles)
        splits = max(1, min(splits, MAX_SPLITS, blocks // MIN_BLOCKS_PER_SPLIT))
    splits = cdiv(blocks, cdiv(blocks, splits))  # no empty split
    return replace(config, split_k=splits)


def _counter_slots(out_features: int) -> int:
    return cdiv(out_features, MIN_BLOCK_N) * MAX_SPLIT_ROW_TILES


def supports(x: torch.Tensor, packed: PackedInt4) -> bool:
    """True when int4_linear takes x for this weight (CUDA, or CPU under the interpreter)."""
    return (
        (x.is_cuda or INTERPRETING)
        and x.dim() == 2
        and x.shape[1] == packed.in_features
        and x.dtype == packed.dtype
        and x.device == packed.device
        and x.stride(1) == 1
        and x.data_ptr() % 4 == 0  # the batch-1 kernel reads x as int32 pairs
    )


def int4_linear(
    x: torch.Tensor,
    packed: PackedInt4,
    bias: torch.Tensor | None = None,
    config: Int4GemmConfig | None = None,
) -> torch.Tensor:
    """x [M, K] (bfloat16 / float16) @ W.T (+ bias [N]) -> y [M, N] in x's dtype, W from `packed`."""
    if not supports(x, packed):
        raise ValueError(
            f"int4_linear takes CUDA x [M, {packed.in_features}] in {packed.dtype} with contiguous rows on "
            f"{packed.device}; got x {tuple(x.shape)} {x.dtype} on {x.device} (stride {x.stride()})"
        )
    rows, in_features = x.shape
    out_features = packed.out_features
    y = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    sms = sm_count(x.device)
    if config is None:
        shared_memory = shared_memory_per_block(kernel_capability(x.device))
        config = choose_config(rows, out_features, in_features, sms, shared_memory, mma_kernel_ok(x, packed))
    else:
        check_config(config, rows)
        if config.kernel == "mma" and not mma_kernel_ok(x, packed):
            raise ValueError(
                f"int4 GEMM config {config}: the mma kernel needs an SM 8.0+ GPU (not the interpreter) "
                f"and integer zero points 0..{MAX_PAIRED_ZERO}; use kernel 'gemv' or 'dot'"
            )
        config = resolve_split(config, rows, out_features, in_features, sms)
    splits = config.split_k
    blocks = cdiv(in_features, BLOCK_K)
    blocks_per_split = cdiv(blocks, splits)
    tiles_n = cdiv(out_features, config.block_n)
    tiles = cdiv(rows, config.block_m) * tiles_n if config.kernel == "dot" else tiles_n
    if splits > 1:
        if tiles > packed.counters.numel():
            raise ValueError(
                f"split-K over {tiles} output tiles needs more than the layer's {packed.counters.numel()} "
                f"counters: use larger tiles or split_k=1 for {rows} rows"
            )
        workspace = torch.empty((splits, rows, out_features), dtype=torch.float32, device=x.device)
    else:
        workspace = y  # not read
    group_size = packed.group_size
    # every kernel's first arguments: the tensors, the sizes and the strides
    bias_or_any = bias if bias is not None else packed.scale_zero  # (not read without a bias)
    args = (x, packed.qweight, packed.scale_zero, bias_or_any, y, workspace, packed.counters, rows,
            out_features, in_features, x.stride(0), packed.qweight.stride(0), y.stride(0))  # fmt: skip
    if config.kernel == "mma":
        args += (cdiv(group_size, BLOCK_K), blocks_per_split, splits)
        _launch_mma(args, packed, config, tiles_n, has_bias=bias is not None)
        return y
    group_j = min(group_size, BLOCK_K) // 32  # groups > 256 codes: multiples of 256, or K (per-channel)
    args += (group_size, blocks_per_split, splits, MAGIC, 16)
    common = {
        "HAS_BIAS": bias is not None,
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "GROUP_J": group_j,
        "EVEN_K": in_features % BLOCK_K == 0,
        "SPLIT": splits > 1,
        # streaming calls ask the L2 for the head of their weight rows before waiting (PDL only)
        "PREFETCH_BYTES": PREFETCH_ROW_BYTES if rows <= SPLIT_MAX_ROWS else 0,
    }
    if config.kernel == "gemv":
        common["INT_ZEROS"] = packed.integer_zeros
        _launch(_int4_gemv_kernel, (tiles_n, splits), args, common, config, x.device)
    else:
        common.update(
            SWAP_AB=config.swap_ab,
            GROUP_M=config.group_m,
            WIDE_K=config.wide_k,
            PAIRED=config.paired and paired_dequant_ok(x, packed),
        )
        _launch(_int4_dot_kernel, (tiles, splits), args, common, config, x.device)
    return y


def _launch_mma(
    args: tuple, packed: PackedInt4, config: Int4GemmConfig, tiles_n: int, has_bias: bool
) -> None:
    """kernels/int4_mma_gemv.py for `args` (int4_linear's, with blocks a group spans, blocks a split
    takes and the split count)."""
    x = args[0]
    _int4_mma_gemv_kernel[(tiles_n, config.split_k)](
        *args,
        HAS_BIAS=has_bias,
        BLOCK_M=config.block_m,
        ROW_TILES=config.block_n // (16 * config.num_warps),
        GROUP_CODES=packed.group_size if packed.group_size in (32, 64, 128) else BLOCK_K,
        EVEN_K=x.shape[1] % BLOCK_K == 0,
        SPLIT=config.split_k > 1,
        num_warps=config.num_warps,
        **pdl_kwargs(x.device),
    )


def mma_kernel_ok(x: torch.Tensor, packed: PackedInt4) -> bool:
    """True when the register-fed tensor-core kernel (kernels/int4_mma_gemv.py) may take x: compiled for
    an SM 8.0+ GPU (mma.sync with 16-bit inputs) where the packed-pair dequantization may run
    (`paired_dequant_ok`: inline PTX, so not under the interpreter; zero points it keeps exact)."""
    if not MMA_DECODE or _int4_mma_gemv_kernel is None or not paired_dequant_ok(x, packed):
        return False
    return kernel_capability(x.device) >= (8, 0)


def paired_dequant_ok(x: torch.Tensor, packed: PackedInt4) -> bool:
    """True when the dot kernel may dequantize in packed 16-bit pairs (kernels/int4_pair_dequant.py) for
    an x that `supports` took: compiled for a GPU (inline PTX: not under the interpreter), zero points
    that stay exact there, and bfloat16 only on sm_80+."""
    if INTERPRETING or not packed.paired_zeros:
        return False
    return x.dtype == torch.float16 or kernel_capability(x.device) >= (8, 0)


def check_config(config: Int4GemmConfig, rows: int) -> None:
    """Raises ValueError for a configuration the kernels cannot run for `rows` rows of x."""
    sizes = (config.block_m, config.block_n, config.num_warps)
    problem = None
    if config.kernel not in ("gemv", "dot", "mma"):
        problem = "kernel must be 'gemv', 'dot' or 'mma'"
    elif any(size < 1 or size & (size - 1) for size in sizes):
        problem = "block_m, block_n and num_warps must be powers of two"
    elif config.kernel == "gemv" and config.block_m < rows:
        problem = f"the gemv kernel takes at most block_m rows, here {rows}"
    elif config.kernel == "dot" and min(config.block_m, config.block_n) < 16:
        problem = "tl.dot needs block_m and block_n >= 16"
    elif config.kernel == "mma" and (config.block_m not in (8, 16) or config.block_m < rows):
        problem = f"the mma kernel takes block_m 8 or 16 and at most block_m rows, here {rows}"
    elif config.kernel == "mma" and config.block_n % (16 * config.num_warps):
        problem = "the mma kernel's block_n is 16 rows x num_warps x row tiles"
    if problem:
        raise ValueError(f"int4 GEMM config {config}: {problem}")


def _launch(kernel, grid, args, constexprs, config: Int4GemmConfig, device: torch.device) -> None:
    options = {"NUM_STAGES": config.num_stages, "num_warps": config.num_warps}
    if config.maxnreg is not None:
        options["maxnreg"] = config.maxnreg
    if INTERPRETING:  # the interpreter runs the JIT function itself, without launch options
        kernel[grid](*args, **constexprs, NUM_STAGES=config.num_stages, USE_PDL=False)
        return
    kernel[grid](*args, **constexprs, **options, **pdl_kwargs(device))
