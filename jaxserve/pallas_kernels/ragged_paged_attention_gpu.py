"""Ragged paged attention as Pallas kernels for GPU (Triton backend); ``interpret=True`` on CPU.

Same inputs and semantics as ``jaxserve.attention.ragged_paged_attention_xla``. Two kernels, both
launched for every step (shapes are static under jit, so which sequences decode is only known on
device); each skips the sequences the other one owns:

  * decode (sequences with exactly one query row): flash-decoding. grid = (seq, kv_head, split);
    a program runs an online softmax over its split of the context for all query heads of its KV
    head (the GQA group, padded to 16 rows for Triton's dot) and writes an unnormalised partial
    (acc, l, m); the splits are combined in XLA afterwards.
  * prefill (sequences with several query rows): queries are regrouped to [kv_heads, T * group, D]
    (row t*group + g = query head kvh*group + g of token t), grid = (kv_head, rows / block_q). A
    block of rows shares one KV head, so each K/V block read serves the whole GQA group; it loops
    over the (precomputed) sequences whose tokens it holds and keeps one per-row online softmax;
    rows of other sequences are masked to -inf and stay untouched.

8-bit pools (int8, float8_e4m3fn) hold K/V in 1 byte; their per-layer, per-head scales are
applied by the caller (q times the K scale, the output times the V scale). The kernels load the
bytes and upcast them to float32 right away (``kv_compute_dtype``), so they compute what they
compute for ``kv_pages.astype(jnp.float32)``: f32 dots at HIGHEST precision, f32 accumulation.

KV is read in blocks of ``block_kv`` token slots: each slot's page comes from the page table by
a vector gather, so the block size is independent of the page size. The pool is passed whole
(no block spec), so nothing is copied per program; K of KV head h is combined head 2h, V 2h+1.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # the Triton namespace and its params class were renamed across jax releases
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None
_CompilerParams = None
if plgpu is not None:
    _CompilerParams = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams", None)


def kv_compute_dtype(kv_dtype) -> jnp.dtype:
    """dtype K/V are computed in: the pool's, except 8-bit pools, upcast to float32 after the load
    (their contract is the f32 pool's result; the dots' operand tiles are then f32 too)."""
    kv_dtype = jnp.dtype(kv_dtype)
    return jnp.dtype(jnp.float32) if kv_dtype.itemsize == 1 else kv_dtype


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class GpuBlocks:
    """Block sizes and limits of one GPU kind (see docs/kernels.md for the reasoning)."""

    shared_bytes: int  # opt-in shared memory per thread block (cudaDevAttrMaxSharedMemoryPerBlockOptin)
    sms: int  # streaming multiprocessors: flash-decoding splits only until the grid fills them
    cc: int  # compute capability (90: Hopper, wgmma available)
    block_q_16bit: int  # prefill rows per program for bf16/f16 pools
    block_q_f32: int  # ... for f32 pools (no tensor cores at HIGHEST precision: FMA, M free)
    block_kv: int  # KV token slots per inner step, both kernels
    num_warps: int = 4
    num_stages: int = 2


# First substring match of the device kind wins. Hopper: block_q 64 = one warpgroup's wgmma M
# (block_q 32 compiles to mma.sync: XLA's compiler and Triton 3.9 for sm_90a, tests/test_gpu_compile.py);
# block_kv 128, measured on an H200 (docs/results/device_sweep_h200.txt): Llama-3-8B bf16 decode at
# batch 128 x 8K context 1,093 us (80% of HBM peak) against 1,186 us at 64, batch 64 x 4K 537 vs
# 569 us, prefill within noise; the tiles are 104 KB (decode) and 144 KB (prefill). Shapes whose
# tiles would not fit (f32, head_dim 256) shrink it (_fit_blocks). f32 runs on FMA at HIGHEST
# precision, so a bigger M buys nothing there. docs/kernels.md has the rest.
GPU_BLOCKS: list[tuple[str, GpuBlocks]] = [
    ("GH200", GpuBlocks(232448, 132, 90, 64, 32, 128)),
    ("H200", GpuBlocks(232448, 132, 90, 64, 32, 128)),
    ("H100", GpuBlocks(232448, 132, 90, 64, 32, 128)),
    ("H800", GpuBlocks(232448, 132, 90, 64, 32, 128)),
    ("A100", GpuBlocks(166912, 108, 80, 32, 32, 64)),
    ("L40", GpuBlocks(101376, 142, 89, 32, 32, 32)),
    ("L4", GpuBlocks(101376, 58, 89, 32, 32, 32)),
]
# What jax assumes when it lowers for CUDA without a device (sm_90), so the same default here.
DEFAULT_GPU_BLOCKS = GPU_BLOCKS[1][1]
_PROGRAMS_PER_SM = 4  # a few resident programs per SM hide memory latency
_MAX_POOL_ELEMENTS = 2**31 - 1  # the Triton lowering computes element offsets in int32


def gpu_blocks_for(device_kind: str) -> GpuBlocks:
    return next((b for k, b in GPU_BLOCKS if k.lower() in device_kind.lower()), DEFAULT_GPU_BLOCKS)


def target_device_kind() -> str:
    """The GPU being compiled for: the local device, else (jax >= 0.11) an abstract mesh's device."""
    if jax.default_backend() == "gpu":
        return jax.devices()[0].device_kind
    try:
        from jax._src import mesh as mesh_lib

        dev = mesh_lib.get_abstract_mesh().abstract_device
        if dev is not None and dev.platform in ("gpu", "cuda"):
            return dev.device_kind
    except (ImportError, AttributeError):  # older jax: no abstract devices
        pass
    return ""


def aot_target(device_kind: str = "NVIDIA H200") -> contextlib.AbstractContextManager:
    """Context in which jax lowers Pallas GPU kernels for ``device_kind`` without a GPU.

    jax >= 0.11 asks an abstract mesh's device for the target (and raises without one); jax 0.10
    falls back to sm_90 on its own. target_device_kind() reads the same device, so block sizes
    follow the target too.
    """
    if jax.default_backend() == "gpu":
        return contextlib.nullcontext()
    dev = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("aot",), abstract_device=dev))


def uses_wgmma(rows: int, itemsize: int, num_warps: int, cc: int) -> bool:
    """Whether Triton picks Hopper's wgmma (MMAv3) for a [rows, D] x [D, block_kv] tile."""
    return cc >= 90 and itemsize == 2 and rows % 64 == 0 and num_warps % 4 == 0


def shared_bytes_estimate(rows: int, block_kv: int, head_dim: int, itemsize: int, wgmma: bool,
                          load_itemsize: int | None = None) -> int:
    """Shared memory Triton allocates for one program of these kernels (rows query rows).

    Fitted to Triton 3.9's sm_90 allocation over head_dim 64/128/256, bf16/f32, rows 16-128,
    block_kv 32-256; XLA's bundled Triton allocates the same or 256 B more (tests/test_gpu_compile.py
    keeps it an upper bound within 5% + 2 KB of both):
    mma.sync/FMA tiles hold K, V and a layout copy of one of them (3 x block_kv x D), the P tile
    (rows x block_kv) and Q (rows x D); wgmma tiles stage K and V twice (4 x block_kv x D) plus Q.
    8-bit pools (load_itemsize 1 < itemsize 4, FMA): K and V as loaded plus their f32 copies, and
    Q; measured 84/88 KB (d64) and 168/176 KB (d128) at 16/32 rows x 128 slots, exactly this
    less the 1 KB, by XLA's Triton for sm_90 (tests/test_gpu_compile.py also checks d256).
    """
    if load_itemsize is not None and load_itemsize < itemsize:
        return block_kv * head_dim * 2 * (load_itemsize + itemsize) + rows * head_dim * itemsize + 1024
    base = itemsize * (block_kv * (3 * head_dim + rows) + rows * head_dim)
    if wgmma:
        base = max(base, itemsize * (4 * head_dim * block_kv + rows * head_dim))
    return base + 1024  # barriers and a third pipeline stage add <= 256 B


def _load_kv(kv_ref, pt_ref, seq, j, kv_len, kvh, block_kv: int, page_size: int, pages_per_seq: int,
             compute_dtype):
    """K, V [block_kv, D] of KV block j of a sequence, in compute_dtype (8-bit pools: upcast right
    after the load); slots past kv_len read the null page and V=0."""
    tok = j * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
    col = jnp.minimum(tok // page_size, pages_per_seq - 1)
    ok = tok < kv_len
    page = jnp.where(ok, pt_ref[seq, col], 0)  # garbage ids past the end are never dereferenced
    off = tok % page_size
    k = kv_ref[page, off, 2 * kvh, :].astype(compute_dtype)
    v = kv_ref[page, off, 2 * kvh + 1, :].astype(compute_dtype)
    v = jnp.where(ok[:, None], v, jnp.zeros_like(v))  # 0 * stale inf/nan would poison the sum
    return k, v, tok


def _online_update(s, v, m, l, acc, precision):
    m_new = jnp.maximum(m, s.max(axis=-1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_safe[:, None])
    alpha = jnp.exp(m - m_safe)
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32, precision=precision)
    return m_new, l * alpha + p.sum(axis=-1), acc * alpha[:, None] + pv


def _scores(q, k, soft_cap, precision):
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                            precision=precision)
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    return s


def _decode_kernel(kv_lens_ref, cu_ref, ns_ref, pt_ref, q_ref, kv_ref, o_ref, l_ref, m_ref, *,
                   sm_scale, sliding_window, soft_cap, block_kv, split_tokens, page_size, pages_per_seq,
                   precision, compute_dtype):
    seq, kvh, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_len = kv_lens_ref[seq]
    is_decode = (seq < ns_ref[0]) & (cu_ref[seq + 1] - cu_ref[seq] == 1)
    q_pos = kv_len - 1
    lo = 0 if sliding_window is None else jnp.maximum(q_pos - sliding_window + 1, 0)
    start = jnp.maximum(split * split_tokens, lo)
    end = jnp.where(is_decode, jnp.minimum((split + 1) * split_tokens, kv_len), 0)
    blk_lo = start // block_kv
    blk_hi = jnp.maximum((end + block_kv - 1) // block_kv, blk_lo)
    blk_hi = jnp.where(end > start, blk_hi, blk_lo)

    q = q_ref[...]
    q = (q.astype(jnp.float32) * sm_scale).astype(compute_dtype)  # [Gp, D]
    gp, d = q.shape

    def body(j, carry):
        m, l, acc = carry
        k, v, tok = _load_kv(kv_ref, pt_ref, seq, j, kv_len, kvh, block_kv, page_size, pages_per_seq,
                             compute_dtype)
        s = _scores(q, k, soft_cap, precision)
        ok = (tok >= start) & (tok < end)  # this split's share, causal and window bounds included
        s = jnp.where(ok[None, :], s, -jnp.inf)
        return _online_update(s, v, m, l, acc, precision)

    init = (jnp.full((gp,), -jnp.inf, jnp.float32), jnp.zeros((gp,), jnp.float32), jnp.zeros((gp, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(blk_lo, blk_hi, body, init)
    o_ref[...] = acc
    l_ref[...] = l
    m_ref[...] = m


def _prefill_kernel(kv_lens_ref, cu_ref, ns_ref, seq_lo_ref, seq_hi_ref, pt_ref, q_ref, kv_ref, o_ref, *,
                    sm_scale, sliding_window, soft_cap, block_kv, page_size, pages_per_seq, group, precision,
                    compute_dtype):
    kvh, qb = pl.program_id(0), pl.program_id(1)
    q = q_ref[...]  # [block_q, D]: rows r0.. of this KV head's [T * group] query rows
    bq, d = q.shape
    q = (q.astype(jnp.float32) * sm_scale).astype(compute_dtype)
    r0 = qb * bq
    tok = (r0 + jnp.arange(bq, dtype=jnp.int32)) // group  # token of each row
    tok_first, tok_last = r0 // group, (r0 + bq - 1) // group

    def seq_body(seq, carry):
        kv_len = kv_lens_ref[seq]
        q_start, q_end = cu_ref[seq], cu_ref[seq + 1]
        q_len = q_end - q_start
        a, b = jnp.maximum(q_start, tok_first), jnp.minimum(q_end, tok_last + 1)  # its tokens here
        first_pos = kv_len - q_len + (a - q_start)
        hi = jnp.minimum(kv_len - q_len + (b - q_start), kv_len)
        lo = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
        live = (a < b) & (q_len > 1) & (hi > lo)  # 1-row sequences belong to the decode kernel
        blk_lo = lo // block_kv
        blk_hi = jnp.where(live, (hi + block_kv - 1) // block_kv, blk_lo)
        in_seq = (tok >= a) & (tok < b)
        q_pos = kv_len - q_len + (tok - q_start)

        def kv_body(j, carry):
            m, l, acc = carry
            k, v, kv_tok = _load_kv(kv_ref, pt_ref, seq, j, kv_len, kvh, block_kv, page_size, pages_per_seq,
                                    compute_dtype)
            s = _scores(q, k, soft_cap, precision)
            ok = in_seq[:, None] & (kv_tok[None, :] < kv_len) & (kv_tok[None, :] <= q_pos[:, None])
            if sliding_window is not None:
                ok = ok & (kv_tok[None, :] > q_pos[:, None] - sliding_window)
            s = jnp.where(ok, s, -jnp.inf)
            return _online_update(s, v, m, l, acc, precision)

        return jax.lax.fori_loop(blk_lo, blk_hi, kv_body, carry)

    init = (jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32), jnp.zeros((bq, d), jnp.float32))
    seq_hi = jnp.minimum(seq_hi_ref[qb], ns_ref[0])
    m, l, acc = jax.lax.fori_loop(seq_lo_ref[qb], seq_hi, seq_body, init)
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


def _row_block_seq_ranges(cu_q_lens: jax.Array, num_blocks: int, block_rows: int,
                          group: int) -> tuple[jax.Array, jax.Array]:
    """[lo, hi) of the sequences owning the tokens of each block of ``block_rows`` grouped rows."""
    ends = cu_q_lens[1:]
    r0 = jnp.arange(num_blocks, dtype=jnp.int32) * block_rows
    lo = jnp.searchsorted(ends, r0 // group, side="right").astype(jnp.int32)
    hi = jnp.searchsorted(ends, (r0 + block_rows - 1) // group, side="right").astype(jnp.int32) + 1
    n = ends.shape[0]
    return jnp.minimum(lo, n), jnp.minimum(hi, n)


def _fit_blocks(*, rows_decode: int, block_q: int | None, block_kv: int | None, head_dim: int, itemsize: int,
                num_warps: int, blocks: GpuBlocks, kind: str, dtype_name: str,
                kv_from: str, load_itemsize: int | None = None) -> tuple[int, int]:
    """Block sizes whose tiles fit the device's shared memory: defaults shrink to fit, explicit
    settings that do not fit are an error (raised while tracing, i.e. at start-up warm-up, before
    any compiler runs)."""
    explicit_q, explicit_kv = block_q is not None, block_kv is not None
    if block_q is None:
        block_q = blocks.block_q_16bit if itemsize == 2 else blocks.block_q_f32
    if block_kv is None:
        block_kv = blocks.block_kv

    def need(bq: int, bkv: int) -> tuple[int, str]:
        dec = shared_bytes_estimate(rows_decode, bkv, head_dim, itemsize, False, load_itemsize)
        pre = shared_bytes_estimate(bq, bkv, head_dim, itemsize, uses_wgmma(bq, itemsize, num_warps, blocks.cc),
                                    load_itemsize)
        return (dec, "decode") if dec > pre else (pre, "prefill")

    while need(block_q, block_kv)[0] > blocks.shared_bytes:
        if not explicit_kv and block_kv > 16:
            block_kv //= 2
        elif not explicit_q and block_q > 16:
            block_q //= 2
        else:
            nbytes, which = need(block_q, block_kv)
            raise ValueError(
                f"GPU attention: block_q={block_q}, block_kv={block_kv} ({kv_from}) need ~{nbytes // 1024} KB of "
                f"shared memory in the {which} kernel (head_dim {head_dim}, {dtype_name}), but "
                f"{kind or 'the default target (sm_90)'} allows {blocks.shared_bytes // 1024} KB per block; "
                f"lower pages_per_block / block_kv (or block_q), or leave them unset to size them automatically")
    return block_q, block_kv


def ragged_paged_attention_gpu(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    split_tokens: int | None = None,
    interpret: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pages_per_block: int | None = None,
    num_splits: int | None = None,
    device_kind: str | None = None,
) -> jax.Array:
    """Ragged paged attention on GPU. q: [T, H, D] -> [T, H, D]; padding rows give zeros.

    block_q: prefill query rows (token x head of one GQA group) per program; block_kv: KV token
    slots per inner step (both powers of two, >= 16 for Triton's dot); split_tokens: context
    tokens per decode split (flash-decoding). By default the split count is the smallest that
    gives every SM a few decode programs (sequences x KV heads x splits), since each split costs
    a partial (acc, l, m) round trip through HBM.
    pages_per_block / num_splits: other spellings of the same knobs (override block_kv / split_tokens).
    Unset block sizes come from GPU_BLOCKS for the target (``device_kind``, by default the local
    GPU's) and shrink to fit its shared memory; explicit ones that do not fit raise ValueError.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, two_kvh, _ = kv_pages.shape
    kv_heads = two_kvh // 2
    group = num_heads // kv_heads
    num_seqs_max, pages_per_seq = page_tables.shape
    kind = target_device_kind() if device_kind is None else device_kind
    blocks = gpu_blocks_for(kind)
    num_warps = blocks.num_warps if num_warps is None else num_warps
    num_stages = blocks.num_stages if num_stages is None else num_stages
    kv_from = "block_kv"
    if pages_per_block is not None:
        block_kv = max(16, _next_pow2(pages_per_block * page_size))
        kv_from = f"pages_per_block={pages_per_block} x page_size={page_size}"
    for name, v in (("block_q", block_q), ("block_kv", block_kv)):
        if v is not None and (v < 16 or v & (v - 1)):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16 for Triton, got {head_dim}")
    g_pad = max(16, _next_pow2(group))
    compute_dtype = kv_compute_dtype(kv_pages.dtype)
    # Tiles (and so shared memory and the tensor-core path) follow the dtype the dots run in.
    itemsize = compute_dtype.itemsize
    if interpret:  # no shared memory to fit; the table's sizes, or what the caller asked for
        block_q = block_q or (blocks.block_q_16bit if itemsize == 2 else blocks.block_q_f32)
        block_kv = block_kv or blocks.block_kv
    else:
        if kv_pages.dtype == jnp.float8_e4m3fn and blocks.cc < 89:
            # Triton 3.9 for sm_80 aborts the process: "LLVM ERROR: Conversion from/to f8e4m3nv is only
            # supported on compute capability >= 89" (tests/test_gpu_compile.py); refuse it while tracing.
            raise ValueError(
                f"GPU attention: a float8_e4m3fn KV pool needs compute capability >= 8.9 (Ada, Hopper) for "
                f"Triton's fp8 conversion; {kind or 'the target'} is sm_{blocks.cc}. Use kv_cache_dtype int8 there")
        block_q, block_kv = _fit_blocks(rows_decode=g_pad, block_q=block_q, block_kv=block_kv, head_dim=head_dim,
                                        itemsize=itemsize, num_warps=num_warps, blocks=blocks, kind=kind,
                                        dtype_name=jnp.dtype(kv_pages.dtype).name, kv_from=kv_from,
                                        load_itemsize=jnp.dtype(kv_pages.dtype).itemsize)
        if kv_pages.size > _MAX_POOL_ELEMENTS:
            raise ValueError(
                f"GPU attention: the KV pool has {kv_pages.size:,} elements ({kv_pages.shape}), past the 2^31 that the "
                f"Triton kernels address with int32 offsets; lower num_pages / kv_cache_memory")
    max_ctx = pages_per_seq * page_size
    ctx_blocks = -(-max_ctx // block_kv)
    if num_splits is None and split_tokens is None:
        programs = num_seqs_max * kv_heads
        # Interpreted, programs run one after another: two splits still exercise the merge.
        num_splits = 2 if interpret else max(1, -(-_PROGRAMS_PER_SM * blocks.sms // programs))
    if num_splits is not None:
        split_tokens = -(-max_ctx // max(1, num_splits))
    # Whole KV blocks per split; recount the splits from the rounded length.
    split_tokens = min(ctx_blocks, max(1, -(-split_tokens // block_kv))) * block_kv
    num_splits = max(1, -(-max_ctx // split_tokens))
    precision = jax.lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
    kv_lens = kv_lens.astype(jnp.int32)
    cu = cu_q_lens.astype(jnp.int32)
    ns = num_seqs.astype(jnp.int32).reshape(-1)[:1]
    # Clamp page ids so no table entry can address memory outside the pool.
    pt = jnp.clip(page_tables.astype(jnp.int32), 0, kv_pages.shape[0] - 1)
    params = {}
    if not interpret and _CompilerParams is not None:
        params["compiler_params"] = _CompilerParams(num_warps=num_warps, num_stages=num_stages)
    full = pl.BlockSpec()  # whole array, indexed inside the kernel

    # Decode: each sequence's last query row (only used where the sequence has exactly one).
    last_row = jnp.clip(cu[1:] - 1, 0, num_tokens - 1)
    qd = q[last_row].reshape(num_seqs_max, kv_heads, group, head_dim)
    qd = jnp.pad(qd, ((0, 0), (0, 0), (0, g_pad - group), (0, 0)))
    dec = functools.partial(_decode_kernel, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                            block_kv=block_kv, split_tokens=split_tokens, page_size=page_size,
                            pages_per_seq=pages_per_seq, precision=precision, compute_dtype=compute_dtype)
    o, l, m = pl.pallas_call(
        dec,
        grid=(num_seqs_max, kv_heads, num_splits),
        in_specs=[full, full, full, full,
                  pl.BlockSpec((None, None, g_pad, head_dim), lambda s, h, k: (s, h, 0, 0)), full],
        out_specs=[pl.BlockSpec((None, None, None, g_pad, head_dim), lambda s, h, k: (s, k, h, 0, 0)),
                   pl.BlockSpec((None, None, None, g_pad), lambda s, h, k: (s, k, h, 0)),
                   pl.BlockSpec((None, None, None, g_pad), lambda s, h, k: (s, k, h, 0))],
        out_shape=[jax.ShapeDtypeStruct((num_seqs_max, num_splits, kv_heads, g_pad, head_dim), jnp.float32),
                   jax.ShapeDtypeStruct((num_seqs_max, num_splits, kv_heads, g_pad), jnp.float32),
                   jax.ShapeDtypeStruct((num_seqs_max, num_splits, kv_heads, g_pad), jnp.float32)],
        interpret=interpret,
        name="jaxserve_rpa_decode",
        **params,
    )(kv_lens, cu, ns, pt, qd, kv_pages)
    # Flash-decoding's second pass: merge the splits' partial softmaxes.
    m_all = m.max(axis=1, keepdims=True)
    m_safe = jnp.where(m_all == -jnp.inf, 0.0, m_all)
    w = jnp.exp(m - m_safe)
    l_all = (l * w).sum(axis=1)
    dec_out = (o * w[..., None]).sum(axis=1) / jnp.where(l_all > 0, l_all, 1.0)[..., None]
    dec_out = dec_out[:, :, :group].reshape(num_seqs_max, num_heads, head_dim)

    # Prefill: rows grouped by KV head, [KVH, T * group, D], so a K/V block serves a whole group.
    rows = num_tokens * group
    rows_pad = -(-rows // block_q) * block_q
    nqb = rows_pad // block_q
    qg = q.reshape(num_tokens, kv_heads, group, head_dim).transpose(1, 0, 2, 3).reshape(kv_heads, rows, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, rows_pad - rows), (0, 0)))
    seq_lo, seq_hi = _row_block_seq_ranges(cu, nqb, block_q, group)
    pre = functools.partial(_prefill_kernel, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                            block_kv=block_kv, page_size=page_size, pages_per_seq=pages_per_seq, group=group,
                            precision=precision, compute_dtype=compute_dtype)
    q_spec = pl.BlockSpec((None, block_q, head_dim), lambda h, i: (h, i, 0))
    out = pl.pallas_call(
        pre,
        grid=(kv_heads, nqb),
        in_specs=[full, full, full, full, full, full, q_spec, full],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        interpret=interpret,
        name="jaxserve_rpa_prefill",
        **params,
    )(kv_lens, cu, ns, seq_lo, seq_hi, pt, qg, kv_pages)
    out = out[:, :rows].reshape(kv_heads, num_tokens, group, head_dim).transpose(1, 0, 2, 3)
    out = out.reshape(num_tokens, num_heads, head_dim)

    # Put decode rows in place; other sequences' rows scatter out of range and are dropped.
    seq_ids = jnp.arange(num_seqs_max, dtype=jnp.int32)
    is_decode = (seq_ids < ns[0]) & (cu[1:] - cu[:-1] == 1)
    dst = jnp.where(is_decode, cu[:-1], num_tokens)
    return out.at[dst].set(dec_out.astype(q.dtype), mode="drop")
