"""Ragged paged attention as a Pallas Mosaic TPU kernel.

Same contract as ``jaxserve.attention.ragged_paged_attention_xla``: one flat batch of query tokens
mixing decodes and prefill chunks, KV pool ``[num_pages, page_size, 2 * kv_heads, head_dim]`` with K
of kv head h at 2h and V at 2h+1.

Design
  * Lane-dense pages. Each page is seen as one slab ``[page_size * W, 128]`` with
    ``W = 2 * kv_heads * head_dim / 128`` rows of 128 lanes per token (a free reshape of the
    row-major pool). One DMA per page brings every head's K and V; the slab's minor dims are
    always (tile-multiple, 128), so Mosaic never sees an untiled combined-head axis (SmolLM2's
    6 heads) nor a 64-wide minor dim. The pool may also be passed in that shape,
    ``[num_pages, page_size * W, 128]`` (``pool_page_size=`` tells the page size): for head_dim 64
    this is the layout to allocate on TPU, because XLA stores a ``[..., 64]`` array minor-dim
    transposed and would copy the whole pool around the kernel call otherwise.
  * K/V of one head are picked out of the slab with sublane-strided loads (Mosaic needs the last
    dim = 128 for them). head_dim 128: K row 2h, V row 2h+1 of every token. head_dim 256 (128m):
    m rows each, concatenated along lanes. head_dim 64: one row ``[K_h | V_h]`` per head; the
    queries are zero-padded to 128 lanes so that q . row = q . K_h, and p @ row gives p @ V_h in
    lanes 64..127 (the MXU is 128 wide anyway). 16-bit pools pack two rows per 32-bit sublane
    word and Mosaic has no strided packed loads: the buffer is read as uint32 words and split into
    halves. With head_dim 64 and an odd kv_heads a word straddles two tokens; then even and odd
    tokens are loaded separately and the KV columns are handled in (evens, odds) order; attention
    does not care about column order as long as the masks follow it.
  * 8-bit pools (int8, float8_e4m3fn; the scales are the caller's): four rows per word, split
    with integer ops into exact f32 values (no int8/fp8 VPU support needed, v4 and v5e included);
    words straddle tokens in periods of up to 4 tokens, handled like the odd-head case above. K/V
    then enter the dots as f32, so the result is the f32 pool's (``kv_pages.astype(jnp.float32)``).
    An 8-bit tile is 32 sublane rows: pages must fill whole tiles (SmolLM2: page_size 32).
  * Queries regrouped outside the kernel to ``[kv_heads, tokens * group, 128*]``: row
    ``t * group + g`` is query head ``h * group + g`` of token t, so one MXU matmul serves a GQA group.
  * Grid ``(query blocks,)``, "parallel" (or "arbitrary", below). A query block of ``block_q`` tokens may hold the tail of
    one sequence, several decodes and the head of another: the kernel walks the sequences that
    intersect the block, and for each the KV blocks its rows can see (causal upper bound,
    sliding-window lower bound), with an online softmax in VMEM scratch.
  * Decode rows: a sequence whose rows in the block fit one narrow, tile-aligned window (a decode,
    or a short chunk) is computed on that window only (``group + tile - 1`` rows rounded up)
    instead of the whole block: a block of 32 decodes no longer does 32x the work.
  * Page tables etc. are scalar prefetch (SMEM). The pool stays in HBM; every KV block is
    ``pages_per_block`` page DMAs into one of two VMEM buffers; block i+1 (possibly the next
    sequence's first) is in flight while block i is computed. Pages no row needs are not fetched,
    and stale VMEM they leave is zeroed/masked so that garbage (even NaN) cannot leak.
  * Across grid steps (a device of one TensorCore: v5e, v6e, v4 as jax's topology presents it):
    the last KV block of a query block starts the DMA of the next query block's first KV block,
    whose step then finds it in flight (its buffer slot kept in SMEM scratch). That needs the
    grid to run in order ("arbitrary"); a megacore device (two TensorCores as one: v5p here)
    keeps "parallel", which splits the grid over its cores, and prefetches within a step only.
  * Limits are checked before Mosaic runs (``check_tpu_limits``): scalar memory for the page
    table, VMEM for the blocks (the scoped VMEM limit is raised from the estimate, up to the
    chip's capacity), page-slab tiling. A violation raises ValueError naming the setting.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Moved between jax versions: memory space ANY lives on pl (new) or pltpu (old); the compiler
# params class was TPUCompilerParams before CompilerParams.
_ANY = getattr(pl, "ANY", None) or getattr(pltpu, "ANY")
_CompilerParams = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")

_LANES = 128  # m/l scratch is lane-replicated: Mosaic handles [R, 128] tiles, not [R, 1] ones

# Block sizes per TPU generation: (query tokens per block, KV tokens per block); KV tokens are
# turned into pages. Keys are matched against device_kind, most specific first.
# Reasoning: decode is HBM-bound, so the KV block should be long enough that the per-block fixed
# cost (loop, DMA issue/wait, a softmax rescale) is small against its transfer: at 4 KiB per token
# (Llama-3-8B bf16, all 8 KV heads), 512 tokens = 2 MiB = ~2.4 us at v5e's 819 GB/s, ~1.3 us at
# v6e's 1.6 TB/s, so faster chips want longer blocks. Two buffers of that fit easily in the
# 64-128 MiB of VMEM of v5e/v5p/v6e; v4's 16 MiB (32 with the limit raised) keeps 256. But a
# block is computed whole: a short sequence pays for a long block's columns on the VPU, so
# blocks stay well below tpu-inference's tuned RPA v3 values (16-32 pages of 128 tokens = 2K-4K
# KV tokens, 8-32 queries per block, for 8K contexts on v7). Query blocks: 32 tokens x group rows
# fills the 128/256-wide MXU for GQA 4-8 in prefill; decodes use the narrow-row path regardless.
# Not tuned on hardware (no TPU here): scripts/device_check.py has the sweep to do it.
TPU_BLOCK_SIZES: dict[str, tuple[int, int]] = {
    "v4": (32, 256),
    "v5 lite": (32, 512),  # v5e reports "TPU v5 lite"
    "v5e": (32, 512),
    "v5p": (32, 1024),
    "v5": (32, 1024),
    "v6": (32, 1024),  # v6e reports "TPU v6 lite"
    "tpu7": (32, 1024),  # "TPU7x"
}
_FALLBACK_BLOCKS = (32, 256)
_INTERPRET_BLOCKS = (8, 32)  # the TPU interpreter simulates every DMA and op: keep blocks small

# Per-core memory by generation, used where jax's tpu_info lacks the chip (bytes).
_FALLBACK_VMEM = 16 * 1024 * 1024
_SMEM_BYTES = 1024 * 1024
_SMEM_RESERVE = 16 * 1024  # Mosaic's own scalars, semaphores and spills share the 1 MiB


def _device_kind() -> str:
    """The TPU generation being compiled for: the mesh's abstract device where one is set (a
    deviceless compile against a TPU topology), else the default device."""
    try:
        from jax._src.pallas.mosaic import tpu_info

        return tpu_info.get_device_kind()
    except (ImportError, AttributeError):
        return jax.devices()[0].device_kind


def _chip_memory() -> tuple[int, int]:
    """(VMEM, SMEM) capacity in bytes per core of the chip being compiled for."""
    try:
        from jax._src.pallas.mosaic import tpu_info

        info = tpu_info.get_tpu_info()
        return int(info.vmem_capacity_bytes), int(info.smem_capacity_bytes)
    except Exception:  # older/newer jax, or not a TPU: conservative v4-class numbers
        return _FALLBACK_VMEM, _SMEM_BYTES


def _one_core_per_chip() -> bool:
    """The device runs a kernel's grid on one TensorCore, not split over two (megacore mode,
    jax's `num_cores > 1`): only then may grid steps hand work to each other (cross-step prefetch)."""
    try:
        from jax._src.pallas.mosaic import tpu_info

        return int(tpu_info.get_tpu_info().num_cores) == 1
    except Exception:  # unknown chip or jax: the safe answer
        return False


def default_block_sizes(page_size: int, interpret: bool = False) -> tuple[int, int]:
    """(block_q tokens, pages_per_block) for this device kind (small ones in interpret mode)."""
    if interpret:
        num_q, kv_tokens = _INTERPRET_BLOCKS
    else:
        kind = _device_kind().lower()
        num_q, kv_tokens = _FALLBACK_BLOCKS
        for key in sorted(TPU_BLOCK_SIZES, key=len, reverse=True):  # most specific key first
            if key in kind:
                num_q, kv_tokens = TPU_BLOCK_SIZES[key]
                break
    return num_q, max(1, kv_tokens // page_size)


def _sublane_tile(dtype: jnp.dtype) -> int:
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class TpuPlan:
    """Static shape plan of one kernel launch, with its memory estimates (bytes)."""

    kv_heads: int
    group: int
    head_dim: int
    lanes_q: int  # query/output lanes per head: head_dim, or 128 for head_dim 64
    rows_per_token: int  # W: 128-lane rows per token in a page slab
    page_size: int
    block_q: int
    pages_per_block: int
    narrow_rows: int  # rows of the narrow (decode) window; == block rows when unused
    vmem_bytes: int
    smem_bytes: int
    vmem_limit_bytes: int


def _vmem_estimate(kv_heads: int, rows: int, lanes_q: int, kv_tokens: int, w: int,
                   q_itemsize: int, kv_itemsize: int) -> int:
    kv_bufs = 2 * kv_tokens * w * _LANES * kv_itemsize
    q_out = 2 * 2 * kv_heads * rows * lanes_q * q_itemsize  # q and o blocks, double-buffered
    scratch = kv_heads * rows * (2 * _LANES + lanes_q) * 4
    # Live values of one head's step: scores, probabilities and masks [rows, kv] in f32, K/V
    # [kv, lanes] (f32 copies for the bf16 split), the PV product.
    temps = 4 * rows * kv_tokens * 4 + 3 * kv_tokens * max(lanes_q, _LANES) * 4 + 2 * rows * lanes_q * 4
    return kv_bufs + q_out + scratch + temps


def _slab_rows(kv_heads: int, head_dim: int) -> tuple[int, int]:
    """(rows of 128 lanes a token takes in the pool slab, query lanes) for this head shape."""
    if head_dim == 64:
        return kv_heads, _LANES
    if head_dim % _LANES == 0 and (head_dim // _LANES == 1 or head_dim // _LANES % 2 == 0):
        return 2 * kv_heads * head_dim // _LANES, head_dim
    raise ValueError(f"the TPU kernel supports head_dim 64, 128 or a multiple of 256, got "
                     f"{head_dim}; use attention_backend='xla'")


def min_page_size(kv_heads: int, head_dim: int, kv_dtype) -> int:
    """The smallest page size (a power of two) whose pages fill whole sublane tiles and whole
    token periods of the pool slab: what plan_tpu_launch accepts. kv_heads: per device."""
    w, _ = _slab_rows(kv_heads, head_dim)
    kv_dtype = jnp.dtype(kv_dtype)
    need = math.lcm(_sublane_tile(kv_dtype) // math.gcd(w, _sublane_tile(kv_dtype)),
                    _token_period(w, _packing(kv_dtype)))
    return 1 << (need - 1).bit_length()


def plan_tpu_launch(
    *, num_tokens: int, num_heads: int, kv_heads: int, head_dim: int, page_size: int,
    max_seqs: int, pages_per_seq: int, q_dtype, kv_dtype, block_q: int | None = None,
    pages_per_block: int | None = None, interpret: bool = False,
    vmem_limit_bytes: int | None = None,
) -> TpuPlan:
    """Choose block sizes for a launch and check them against the chip, before Mosaic runs.

    Raises ValueError naming the limit and the engine setting to change."""
    if num_heads % kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of kv_heads {kv_heads}")
    kv_dtype = jnp.dtype(kv_dtype)
    if kv_dtype.itemsize == 1 and kv_dtype not in KV_8BIT_DTYPES:  # the unpacking decodes these two only
        raise ValueError(f"TPU kernel: 8-bit KV must be int8 or float8_e4m3fn, got {kv_dtype.name}")
    group = num_heads // kv_heads
    w, lanes_q = _slab_rows(kv_heads, head_dim)
    kv_tile = _sublane_tile(kv_dtype)
    if not interpret and (page_size * w) % kv_tile:
        raise ValueError(
            f"TPU kernel: a page of {page_size} tokens x {w} rows of 128 lanes does not fill whole "
            f"{kv_tile}-row sublane tiles for {jnp.dtype(kv_dtype).name} KV; use a page_size that is a "
            f"multiple of {kv_tile // math.gcd(w, kv_tile)}")
    period = _token_period(w, _packing(kv_dtype))
    if page_size % period:  # KV blocks are read in whole periods of tokens (_SlabReader)
        raise ValueError(f"TPU kernel: {w} rows of 128 lanes per token and {jnp.dtype(kv_dtype).name} KV "
                         f"need a page_size that is a multiple of {period}")
    vmem_cap, smem_cap = (64 * 1024 * 1024, _SMEM_BYTES) if interpret else _chip_memory()

    # Scalar memory: the flattened page table plus per-sequence lengths and per-block starts.
    q_tile = _sublane_tile(q_dtype)
    d_q, d_kv = default_block_sizes(page_size, interpret)
    q_per_blk = block_q or d_q
    q_per_blk = min(q_per_blk, _round_up(num_tokens, 8))
    q_per_blk = _round_up(q_per_blk, q_tile)
    num_q_blocks = -(-num_tokens // q_per_blk)
    smem = 4 * (max_seqs * pages_per_seq + 2 * max_seqs + 2 + num_q_blocks)
    if smem > smem_cap - _SMEM_RESERVE:
        raise ValueError(
            f"TPU kernel: the page table of {max_seqs} sequences x {pages_per_seq} pages "
            f"({max_seqs * pages_per_seq} int32) needs {smem / 2**20:.2f} MiB of scalar memory; "
            f"the chip has {smem_cap / 2**20:.2f} MiB. Lower max_num_seqs or max_model_len, or raise "
            f"page_size (max_num_seqs x max_model_len / page_size must stay below "
            f"{(smem_cap - _SMEM_RESERVE) // 4 - 2 * max_seqs - 2 - num_q_blocks})")

    ppb = max(1, min(pages_per_block or d_kv, pages_per_seq))
    rows = q_per_blk * group
    est = functools.partial(_vmem_estimate, kv_heads, lanes_q=lanes_q, w=w,
                            q_itemsize=jnp.dtype(q_dtype).itemsize, kv_itemsize=jnp.dtype(kv_dtype).itemsize)
    budget = (vmem_limit_bytes or vmem_cap) * 3 // 4  # headroom for Mosaic's internal scratch
    # Too big for VMEM: halve the KV block first (costs per-block overhead only), then the q block.
    while est(rows, kv_tokens=ppb * page_size) > budget and (ppb > 1 or q_per_blk > q_tile):
        if ppb > 1 and (ppb * page_size > 128 or q_per_blk <= q_tile):
            ppb //= 2
        else:
            q_per_blk = max(q_tile, q_per_blk // 2)
            rows = q_per_blk * group
    vmem = est(rows, kv_tokens=ppb * page_size)
    if vmem > budget:
        raise ValueError(
            f"TPU kernel: {vmem / 2**20:.1f} MiB of VMEM needed at the smallest blocks, "
            f"{budget / 2**20:.1f} MiB usable; lower page_size or use attention_backend='xla'")
    # Narrow (decode) window, from a tile-aligned start. A decode's `group` rows start at a
    # multiple of group: when group and the tile divide one another they never straddle a window
    # of max(group, tile) rows (Llama's group 4 in bf16: 16 rows); otherwise the window must
    # cover `group` rows at any offset. Longer chunks use it when they fit (checked in-kernel).
    if q_tile % group == 0 or group % q_tile == 0:
        narrow = min(rows, max(group, q_tile))
    else:
        narrow = min(rows, _round_up(group + q_tile - 1, q_tile))
    limit = vmem_limit_bytes or min(vmem_cap, max(32 * 1024 * 1024, _round_up(2 * vmem, 2**20)))
    return TpuPlan(kv_heads=kv_heads, group=group, head_dim=head_dim, lanes_q=lanes_q, rows_per_token=w,
                   page_size=page_size, block_q=q_per_blk, pages_per_block=ppb, narrow_rows=narrow,
                   vmem_bytes=vmem, smem_bytes=smem, vmem_limit_bytes=limit)


def check_tpu_limits(*, num_heads: int, kv_heads: int, head_dim: int, page_size: int, max_num_seqs: int,
                     max_model_len: int, max_num_batched_tokens: int, dtype, block_q: int | None = None,
                     pages_per_block: int | None = None, kv_dtype=None) -> TpuPlan:
    """Start-up check of the engine's largest bucket against the chip; raises ValueError naming
    the setting to change. (Buckets tie sequences to tokens: S = min(T, max_num_seqs).)
    kv_dtype: the pool's dtype when it differs from the model's (int8 / float8_e4m3fn)."""
    return plan_tpu_launch(
        num_tokens=max_num_batched_tokens, num_heads=num_heads, kv_heads=kv_heads, head_dim=head_dim,
        page_size=page_size, max_seqs=min(max_num_seqs, max_num_batched_tokens),
        pages_per_seq=-(-max_model_len // page_size), q_dtype=dtype, kv_dtype=kv_dtype or dtype,
        block_q=block_q, pages_per_block=pages_per_block)


def _regroup_queries(q: jax.Array, kv_heads: int, num_tokens_padded: int, lanes: int) -> jax.Array:
    """[T, H, D] -> [KVH, T_pad * G, lanes] with row t*G + g = head kvh*G + g of token t."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // kv_heads
    q = jnp.pad(q, ((0, num_tokens_padded - num_tokens), (0, 0), (0, lanes - head_dim)))
    q = q.reshape(num_tokens_padded, kv_heads, group, lanes).transpose(1, 0, 2, 3)
    return q.reshape(kv_heads, num_tokens_padded * group, lanes)


def _ungroup_output(o: jax.Array, num_tokens: int, num_heads: int, head_dim: int) -> jax.Array:
    kv_heads, rows, lanes = o.shape
    group = num_heads // kv_heads
    o = o[..., lanes - head_dim:]  # head_dim 64: p @ V sits in lanes 64..127
    o = o.reshape(kv_heads, rows // group, group, head_dim).transpose(1, 0, 2, 3)
    return o.reshape(rows // group, num_heads, head_dim)[:num_tokens]


KV_8BIT_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def _packing(kv_dtype) -> int:
    """KV rows per 32-bit sublane word: 1 (f32), 2 (bf16), 4 (int8, fp8)."""
    return 4 // jnp.dtype(kv_dtype).itemsize


def _token_period(w: int, packing: int) -> int:
    """Tokens after which the row -> (word, part) pattern of a slab repeats: a token has w rows,
    a word `packing` rows, so it is packing / gcd(w, packing) (1 when words never straddle tokens)."""
    return packing // math.gcd(w, packing)


def _kv_compute_dtype(kv_dtype) -> jnp.dtype:
    """dtype K/V enter the dots in: the pool's, but f32 for 8-bit pools (their contract is the
    result for ``kv_pages.astype(jnp.float32)``; the unpacking yields f32 exactly anyway)."""
    kv_dtype = jnp.dtype(kv_dtype)
    return jnp.dtype(jnp.float32) if kv_dtype.itemsize == 1 else kv_dtype


class _SlabReader:
    """K and V of one kv head out of a VMEM buffer of page slabs ``[kv_tokens * W, 128]``.

    ``strided``: Mosaic sublane-strided loads and a uint32 view of packed buffers (TPU).
    ``emulated``: the same index arithmetic on loaded values (reshape + index, lax bitcasts), which
    the TPU interpreter runs; it checks every start/stride/part choice of the strided path on CPU.

    Packed pools (2 or 4 rows per 32-bit word: rows p*i + j are part j of word i, low bits
    first, as ``pltpu.bitcast`` defines it) are read as words and split with integer ops, which
    every TPU generation has (no bf16/int8/fp8 VPU needed). When W is not a multiple of the
    packing, a word straddles tokens: token t = P*u + c (P = _token_period) has row r in word
    (W*P*u + W*c + r) // p, so each class c is one strided load, and the KV columns come out
    class-major (tokens c, P+c, 2P+c, ... for c = 0..P-1); the masks follow via column_tokens.
    """

    def __init__(self, buf, kv_tokens: int, w: int, head_dim: int, kv_heads: int, mode: str):
        self.buf, self.kv, self.w, self.d, self.kvh, self.mode = buf, kv_tokens, w, head_dim, kv_heads, mode
        self.dtype = jnp.dtype(buf.dtype)
        self.pack = _packing(self.dtype)
        self.period = _token_period(w, self.pack)
        self._loaded: dict = {}  # K and V rows often share words: load each word row once

    def _bitcast(self, x, dtype):
        if self.mode == "strided":
            return pltpu.bitcast(x, dtype)
        return lax.bitcast_convert_type(x, dtype)

    def _rows(self, start: int, n: int, stride: int, words: bool):
        """Rows start, start+stride, ... (n of them) of the buffer or of its uint32 word view."""
        key = (start, n, stride, words)
        if key in self._loaded:
            return self._loaded[key]
        if self.mode == "strided":
            ref = self.buf.bitcast(jnp.uint32) if words else self.buf
            if stride == 1:  # every row: start is 0 and n the whole buffer
                x = ref[...]
            else:
                x = ref[pl.ds(start, n, stride=stride), :]
        else:
            x = self.buf[...]
            if words:  # rows p*i + j are part j of word i
                x = x.reshape(x.shape[0] // self.pack, self.pack, _LANES).transpose(0, 2, 1)
                x = lax.bitcast_convert_type(x, jnp.uint32)
            x = x.reshape(n, stride, _LANES)[:, start, :]
        self._loaded[key] = x
        return x

    def _part(self, w, j: int):
        """Part j of each word as f32, exactly the value ``astype(jnp.float32)`` gives."""
        if self.pack == 2:  # a bf16 is the top half of an f32
            bits = (w & jnp.uint32(0xFFFF0000)) if j == 1 else (w << 16)
            return self._bitcast(bits, jnp.float32)
        if self.dtype == jnp.int8:  # move byte j to the top, then an arithmetic shift sign-extends it
            top = self._bitcast(w << (24 - 8 * j), jnp.int32)
            return (top >> 24).astype(jnp.float32)
        # float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits, no inf, S.1111.111 = NaN.
        # Compares and the int -> float convert run on int32 (signed ops exist everywhere).
        negative = self._bitcast(w << (24 - 8 * j), jnp.int32) < 0
        mag = ((w >> (8 * j)) if j else w) & jnp.uint32(0x7F)
        normal = self._bitcast((mag << 20) + jnp.uint32((127 - 7) << 23), jnp.float32)  # rebias 7 -> 127
        mag = self._bitcast(mag, jnp.int32)
        x = jnp.where(mag < 8, mag.astype(jnp.float32) * (2.0 ** -9), normal)  # exponent 0: m * 2^-9
        x = jnp.where(mag == 0x7F, jnp.nan, x)
        return jnp.where(negative, -x, x)

    def _token_row(self, r: int):
        """Row r of every token of the block, [kv_tokens, 128], columns in class-major order;
        f32 for packed pools, the buffer's dtype otherwise."""
        if self.pack == 1:
            return self._rows(r, self.kv, self.w, False)
        p, per = self.pack, self.period
        stride = self.w * per // p  # words per period of tokens
        parts = []
        for c in range(per):
            g = self.w * c + r  # row of token c within the period's words
            parts.append(self._part(self._rows(g // p, self.kv // per, stride, True), g % p))
        return parts[0] if per == 1 else jnp.concatenate(parts, axis=0)

    def load(self, h: int) -> tuple[jax.Array, jax.Array]:
        """(K, V) of head h, [kv_tokens, lanes]; f32 for packed pools (the word split yields f32)."""
        if self.d == 64:  # one row [K_h | V_h] per token
            x = self._token_row(h)
            return x, x
        m = self.d // _LANES  # rows per K (and per V) of a head
        cat = (lambda parts: parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1))
        return (cat([self._token_row(2 * h * m + j) for j in range(m)]),
                cat([self._token_row((2 * h + 1) * m + j) for j in range(m)]))

    def column_tokens(self, shape: tuple[int, int], axis: int) -> jax.Array:
        """Token index within the KV block of each column (iota along `axis`)."""
        j = lax.broadcasted_iota(jnp.int32, shape, axis)
        if self.period == 1:
            return j
        n = self.kv // self.period  # columns per class; compares, not a vector divide
        tok = j * self.period
        for c in range(1, self.period):
            tok = jnp.where(j >= c * n, (j - c * n) * self.period + c, tok)
        return tok


def _kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,  # [S]
    page_tables_ref,  # [S * P] flattened: 2-D SMEM arrays pad their minor dim
    cu_q_lens_ref,  # [S + 1]
    num_seqs_ref,  # [1]
    first_seq_ref,  # [num_q_blocks] first sequence with a token in each query block
    # inputs
    q_ref,  # VMEM [KVH, R, Lq], R = block_q * group
    kv_hbm_ref,  # HBM [N, page_size * W, 128]
    # outputs
    o_ref,  # VMEM [KVH, R, Lq]
    # scratch
    kv_buf,  # VMEM [2, pages_per_blk * page_size * W, 128]
    sems,  # DMA semaphores [2]
    pf_ref,  # SMEM int32 [1]: the slot a previous grid step prefetched this step's first block into, or -1
    m_ref,  # VMEM f32 [KVH, R, 128] running max, lane-replicated
    l_ref,  # VMEM f32 [KVH, R, 128] running denominator
    acc_ref,  # VMEM f32 [KVH, R, Lq] running numerator
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    group: int,
    max_seqs: int,
    pages_per_seq: int,
    pages_per_blk: int,
    page_size: int,
    head_dim: int,
    narrow_rows: int,
    row_tile: int,
    kv_split: str,
    cross_step: bool,
):
    kv_heads, rows, lanes_q = q_ref.shape
    page_rows = kv_hbm_ref.shape[1]
    w = page_rows // page_size
    kv_per_blk = pages_per_blk * page_size
    tokens_per_blk = rows // group
    q_blk = pl.program_id(0)
    tok_lo = q_blk * tokens_per_blk
    tok_hi = tok_lo + tokens_per_blk
    num_seqs = jnp.minimum(num_seqs_ref[0], max_seqs)
    num_q_blks = pl.num_programs(0)
    f32_inputs = jnp.dtype(q_ref.dtype) == jnp.float32

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def seq_live(seq, tok_hi=tok_hi):
        """Sequence `seq` is real and starts before this query block ends."""
        seq_c = jnp.minimum(seq, max_seqs - 1)
        return (seq < num_seqs) & (cu_q_lens_ref[seq_c] < tok_hi)

    def seq_span(seq, tok_lo=tok_lo, tok_hi=tok_hi):
        """KV range [kv_lo, kv_hi) that the rows of `seq` inside the query block [tok_lo, tok_hi)
        attend to (this grid step's block unless told otherwise)."""
        seq_c = jnp.minimum(seq, max_seqs - 1)
        q_start = cu_q_lens_ref[seq_c]
        q_end = cu_q_lens_ref[seq_c + 1]
        kv_len = kv_lens_ref[seq_c]
        first_tok = jnp.maximum(q_start, tok_lo)
        last_tok = jnp.minimum(q_end, tok_hi) - 1
        offset = kv_len - (q_end - q_start) - q_start  # query token t sits at KV position t + offset
        kv_hi = jnp.minimum(kv_len, last_tok + offset + 1)
        kv_lo = jnp.int32(0)
        if sliding_window is not None:
            kv_lo = jnp.maximum(0, first_tok + offset - sliding_window + 1)
        nonempty = (first_tok <= last_tok) & (kv_hi > kv_lo)
        blk_lo = kv_lo // kv_per_blk
        blk_hi = jnp.where(nonempty, (kv_hi + kv_per_blk - 1) // kv_per_blk, blk_lo)
        # Narrow window: tile-aligned rows [win, win + narrow_rows) holding all of seq's rows here.
        r0 = (first_tok - tok_lo) * group
        r1 = (last_tok + 1 - tok_lo) * group
        win = jnp.minimum((r0 // row_tile) * row_tile, rows - narrow_rows)
        narrow = (r1 - win) <= narrow_rows
        return dict(q_start=q_start, q_end=q_end, offset=offset, kv_lo=kv_lo, kv_hi=kv_hi,
                    blk_lo=blk_lo, blk_hi=blk_hi, seq_c=seq_c, win=win, narrow=narrow)

    def page_range(span, blk):
        """[lo, hi) of the pages of KV block `blk` that hold positions in [kv_lo, kv_hi): only those
        are fetched (one contiguous run); a loop, not an unrolled list, to keep the kernel small."""
        first = blk * pages_per_blk
        lo = jnp.clip(span["kv_lo"] // page_size - first, 0, pages_per_blk)
        end = jnp.minimum((span["kv_hi"] + page_size - 1) // page_size, pages_per_seq)
        hi = jnp.clip(end - first, lo, pages_per_blk)
        return lo, hi

    def page_copy(span, blk, slot, i):
        page_in_seq = blk * pages_per_blk + i
        page = page_tables_ref[span["seq_c"] * pages_per_seq + page_in_seq]
        dst = kv_buf.at[slot, pl.ds(pl.multiple_of(i * page_rows, page_rows), page_rows), :]
        return pltpu.make_async_copy(kv_hbm_ref.at[page], dst, sems.at[slot])

    def start_block(span, blk, slot):
        lo, hi = page_range(span, blk)

        def body(i, carry):
            page_copy(span, blk, slot, i).start()
            return carry

        lax.fori_loop(lo, hi, body, 0)

    def wait_block(span, blk, slot):
        lo, hi = page_range(span, blk)

        def body(i, carry):
            page_copy(span, blk, slot, i).wait()
            return carry

        lax.fori_loop(lo, hi, body, 0)

    precision = lax.Precision.HIGHEST if f32_inputs else None
    kv_dtype = _kv_compute_dtype(kv_buf.dtype)  # 8-bit pools: f32, as if the pool were upcast

    def compute_block(span, blk, slot, row0, nrows: int):
        """Fold KV block `blk` into the softmax state of rows [row0, row0 + nrows)."""
        reader = _SlabReader(kv_buf.at[slot], kv_per_blk, w, head_dim, kv_heads, kv_split)
        kv_start = blk * kv_per_blk
        shape = (nrows, kv_per_blk)
        row_tok = tok_lo + (row0 + lax.broadcasted_iota(jnp.int32, shape, 0)) // group
        col_pos = kv_start + reader.column_tokens(shape, 1)
        row_pos = row_tok + span["offset"]
        in_seq = (row_tok >= span["q_start"]) & (row_tok < span["q_end"])
        mask = in_seq & (col_pos <= row_pos) & (col_pos < span["kv_hi"])
        if sliding_window is not None:
            mask &= col_pos > row_pos - sliding_window
        row_tok_l = tok_lo + (row0 + lax.broadcasted_iota(jnp.int32, (nrows, _LANES), 0)) // group
        update_l = (row_tok_l >= span["q_start"]) & (row_tok_l < span["q_end"])
        row_tok_d = tok_lo + (row0 + lax.broadcasted_iota(jnp.int32, (nrows, lanes_q), 0)) // group
        update_d = (row_tok_d >= span["q_start"]) & (row_tok_d < span["q_end"])
        kv_pos = kv_start + reader.column_tokens((kv_per_blk, lanes_q), 0)
        kv_valid = (kv_pos >= span["kv_lo"]) & (kv_pos < span["kv_hi"])
        rs = pl.ds(row0, nrows)

        for h in range(kv_heads):
            k, v = reader.load(h)
            # Stale or garbage slots (even NaN) must not reach either matmul: 0 * NaN = NaN.
            k = jnp.where(kv_valid, k, 0.0).astype(kv_dtype)
            v = k if head_dim == 64 else jnp.where(kv_valid, v, 0.0).astype(kv_dtype)
            q = q_ref[h, rs, :]
            s = lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32) * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(mask, s, -jnp.inf)
            m_prev = jnp.max(m_ref[h, rs, :], axis=1, keepdims=True)
            l_prev = jnp.max(l_ref[h, rs, :], axis=1, keepdims=True)
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing to see yet
            p = jnp.exp(s - m_safe)
            alpha = jnp.exp(m_prev - m_safe)
            l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32)
            # Only this sequence's rows move; the rest of the block belongs to other sequences.
            m_ref[h, rs, :] = jnp.where(update_l, jnp.broadcast_to(m_new, (nrows, _LANES)), m_ref[h, rs, :])
            l_ref[h, rs, :] = jnp.where(update_l, jnp.broadcast_to(l_new, (nrows, _LANES)), l_ref[h, rs, :])
            acc_ref[h, rs, :] = jnp.where(update_d, alpha * acc_ref[h, rs, :] + pv, acc_ref[h, rs, :])

    def compute(span, blk, slot):
        if narrow_rows >= rows:
            compute_block(span, blk, slot, 0, rows)
            return

        @pl.when(span["narrow"])
        def _():
            compute_block(span, blk, slot, pl.multiple_of(span["win"], row_tile), narrow_rows)

        @pl.when(jnp.logical_not(span["narrow"]))
        def _():
            compute_block(span, blk, slot, 0, rows)

    def seq_cond(carry):
        seq, _, _ = carry
        return seq_live(seq)

    def seq_body(carry):
        seq, slot, pending = carry
        span = seq_span(seq)
        has_blocks = span["blk_hi"] > span["blk_lo"]

        @pl.when(has_blocks & (pending == 0))
        def _():
            start_block(span, span["blk_lo"], slot)

        nxt = seq + 1
        nxt_span = seq_span(nxt)
        prefetch_next = seq_live(nxt) & (nxt_span["blk_hi"] > nxt_span["blk_lo"])
        if cross_step:  # the next grid step's first block, computed as that step will compute it
            step_seq = first_seq_ref[jnp.minimum(q_blk + 1, num_q_blks - 1)]
            step_lo, step_hi = tok_lo + tokens_per_blk, tok_hi + tokens_per_blk
            step_span = seq_span(step_seq, step_lo, step_hi)
            prefetch_step = ((q_blk + 1 < num_q_blks) & jnp.logical_not(seq_live(nxt))
                             & seq_live(step_seq, step_hi) & (step_span["blk_hi"] > step_span["blk_lo"]))

        def kv_body(blk, slot):
            last = blk + 1 == span["blk_hi"]

            @pl.when(jnp.logical_not(last))
            def _():
                start_block(span, blk + 1, 1 - slot)

            @pl.when(last & prefetch_next)
            def _():  # keep the DMA engine busy across the sequence boundary
                start_block(nxt_span, nxt_span["blk_lo"], 1 - slot)

            if cross_step:
                @pl.when(last & prefetch_step)
                def _():  # ... and across the grid step boundary
                    start_block(step_span, step_span["blk_lo"], 1 - slot)
                    pf_ref[0] = 1 - slot

            wait_block(span, blk, slot)
            compute(span, blk, slot)
            return 1 - slot

        slot = lax.fori_loop(span["blk_lo"], span["blk_hi"], kv_body, slot)
        pending = (has_blocks & prefetch_next).astype(jnp.int32)
        return nxt, slot, pending

    slot0, pending0 = jnp.int32(0), jnp.int32(0)
    if cross_step:  # a block the previous step started for this one (pf_ref is garbage at step 0)
        prefetched = (q_blk > 0) & (pf_ref[0] >= 0)
        slot0 = jnp.where(prefetched, pf_ref[0], 0)
        pending0 = prefetched.astype(jnp.int32)
        pf_ref[0] = -1
    lax.while_loop(seq_cond, seq_body, (first_seq_ref[q_blk], slot0, pending0))

    for h in range(kv_heads):
        l = jnp.max(l_ref[h], axis=1, keepdims=True)
        out = acc_ref[h] / jnp.where(l > 0.0, l, 1.0)
        o_ref[h] = jnp.where(l > 0.0, out, 0.0).astype(o_ref.dtype)


def q_block_seq_ranges(cu_q_lens: jax.Array, num_q_blocks: int, block_q: int) -> tuple[jax.Array, jax.Array]:
    """[lo, hi) of the sequences whose query rows intersect each q block of ``block_q`` rows."""
    ends = cu_q_lens[1:]
    r0 = jnp.arange(num_q_blocks, dtype=jnp.int32) * block_q
    lo = jnp.searchsorted(ends, r0, side="right").astype(jnp.int32)
    hi = jnp.searchsorted(ends, r0 + block_q - 1, side="right").astype(jnp.int32) + 1
    n = ends.shape[0]
    return jnp.minimum(lo, n), jnp.minimum(hi, n)


def pool_as_slabs(kv_pages: jax.Array) -> jax.Array:
    """[N, page_size, 2*KVH, D] -> [N, page_size * 2*KVH*D/128, 128], the kernel's page view."""
    n, ps, c, d = kv_pages.shape
    if (c * d) % _LANES:
        raise ValueError(f"2 * kv_heads * head_dim = {c * d} is not a multiple of 128")
    return kv_pages.reshape(n, ps * c * d // _LANES, _LANES)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "block_q", "pages_per_block",
                     "vmem_limit_bytes", "kv_split", "interpret", "pool_page_size", "cross_step_prefetch"),
)
def ragged_paged_attention_tpu(
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
    pages_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
    kv_split: str | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    pool_page_size: int | None = None,
    cross_step_prefetch: bool | None = None,
) -> jax.Array:
    """Ragged paged attention on TPU. q: [T, H, D] -> [T, H, D]; padding rows give zeros.

    kv_pages: [N, page_size, 2*KVH, D], or the lane-dense [N, page_size * 2*KVH*D/128, 128]
      with ``pool_page_size`` (no relayout copy for head_dim 64; see the module doc).
    block_q: query tokens per grid step (rounded up to the sublane tile).
    pages_per_block: pages per KV block (one DMA each, double-buffered).
    vmem_limit_bytes: scoped VMEM limit; by default raised from the estimate up to the chip's VMEM.
    kv_split: how K/V are picked out of a page slab: "strided" (sublane-strided loads, TPU) or
      "emulated" (the same arithmetic on loaded values; what the TPU interpreter runs, the default
      in interpret mode). "indexed" is accepted as an old name of "emulated".
    interpret: True or a ``pltpu.InterpretParams`` runs the kernel in TPU interpret mode (CPU).
    cross_step_prefetch: start the next grid step's first KV block during this step's last one
      (the grid then runs in order). None: on single-TensorCore devices, off in interpret mode.
    """
    num_tokens, num_heads, head_dim = q.shape
    if kv_pages.ndim == 4:
        num_pages, page_size, combined, head_dim_kv = kv_pages.shape
        kv_heads = combined // 2
        if combined % 2 or num_heads % kv_heads or head_dim_kv != head_dim:
            raise ValueError(f"incompatible shapes q={q.shape} kv_pages={kv_pages.shape}")
        slabs = pool_as_slabs(kv_pages)
    elif kv_pages.ndim == 3 and pool_page_size:
        slabs, page_size = kv_pages, pool_page_size
        num_pages, page_rows, _ = kv_pages.shape
        kv_heads = page_rows * _LANES // (2 * page_size * head_dim)
        if kv_pages.shape[2] != _LANES or kv_heads * 2 * page_size * head_dim != page_rows * _LANES:
            raise ValueError(f"incompatible shapes q={q.shape} kv_pages={kv_pages.shape} page_size={page_size}")
    else:
        raise ValueError(f"kv_pages must be [N, page, 2*KVH, D] or [N, rows, 128] with pool_page_size; "
                         f"got {kv_pages.shape}")
    max_seqs, pages_per_seq = page_tables.shape
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    kv_split = {"indexed": "emulated"}.get(kv_split, kv_split) or ("emulated" if interpret else "strided")
    if cross_step_prefetch is None:
        cross_step_prefetch = not interpret and _one_core_per_chip()
    if kv_split not in ("strided", "emulated"):
        raise ValueError(f"kv_split must be 'strided' or 'emulated', got {kv_split!r}")
    if kv_split == "emulated" and not interpret and kv_pages.dtype.itemsize != 4:
        # Mosaic rejects the value-level bf16 -> uint32 pair bitcast ("Changing bitwidths not supported")
        raise ValueError("kv_split='emulated' is for the TPU interpreter; on a TPU 8/16-bit pools need 'strided'")

    plan = plan_tpu_launch(
        num_tokens=num_tokens, num_heads=num_heads, kv_heads=kv_heads, head_dim=head_dim,
        page_size=page_size, max_seqs=max_seqs, pages_per_seq=pages_per_seq, q_dtype=q.dtype,
        kv_dtype=kv_pages.dtype, block_q=block_q, pages_per_block=pages_per_block,
        interpret=bool(interpret), vmem_limit_bytes=vmem_limit_bytes)
    group = plan.group
    q_per_blk = plan.block_q
    num_q_blocks = -(-num_tokens // q_per_blk)
    rows = q_per_blk * group
    lanes_q = plan.lanes_q

    q_grouped = _regroup_queries(q, kv_heads, num_q_blocks * q_per_blk, lanes_q)
    # Clamp page ids: a bad table entry must not become an out-of-bounds DMA.
    tables = jnp.clip(page_tables.astype(jnp.int32), 0, num_pages - 1).reshape(-1)
    kv_lens = kv_lens.astype(jnp.int32)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    num_seqs = num_seqs.astype(jnp.int32).reshape(1)
    first_seq, _ = q_block_seq_ranges(cu_q_lens, num_q_blocks, q_per_blk)

    q_spec = pl.BlockSpec((kv_heads, rows, lanes_q), lambda qb, *_: (0, qb, 0))
    kernel = functools.partial(
        _kernel, sm_scale=float(sm_scale), sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap), group=group, max_seqs=max_seqs,
        pages_per_seq=pages_per_seq, pages_per_blk=plan.pages_per_block, page_size=page_size,
        head_dim=head_dim, narrow_rows=plan.narrow_rows, row_tile=_sublane_tile(q.dtype),
        kv_split=kv_split, cross_step=cross_step_prefetch)
    if interpret is True:
        interpret = pltpu.InterpretParams()
    kv_rows = plan.pages_per_block * page_size * plan.rows_per_token
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(num_q_blocks,),
            in_specs=[q_spec, pl.BlockSpec(memory_space=_ANY)],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((2, kv_rows, _LANES), kv_pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SMEM((1,), jnp.int32),
                pltpu.VMEM((kv_heads, rows, _LANES), jnp.float32),
                pltpu.VMEM((kv_heads, rows, _LANES), jnp.float32),
                pltpu.VMEM((kv_heads, rows, lanes_q), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q_grouped.shape, q.dtype),
        compiler_params=_CompilerParams(
            dimension_semantics=("arbitrary" if cross_step_prefetch else "parallel",),
            vmem_limit_bytes=None if interpret else plan.vmem_limit_bytes),
        interpret=interpret or False,
        name="ragged_paged_attention_tpu",
    )(kv_lens, tables, cu_q_lens, num_seqs, first_seq, q_grouped, slabs)
    return _ungroup_output(out, num_tokens, num_heads, head_dim)


def write_kv_rows(pool_slabs: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
                  page_size: int) -> jax.Array:
    """KV write into a lane-dense pool ``[N, page_size * W, 128]``: new K/V [T, KVH, D] into their
    slots. Same bytes as ``jaxserve.attention.write_kv`` on the 4-D pool, but a scatter of whole
    128-lane rows (slot s owns rows s*W .. s*W+W-1), so XLA keeps the pool's layout (no copies)."""
    num_pages, page_rows, lanes = pool_slabs.shape
    w = page_rows // page_size
    kv = jnp.stack([k, v], axis=2).reshape(k.shape[0] * w, lanes).astype(pool_slabs.dtype)
    rows = (slot_mapping[:, None] * w + jnp.arange(w, dtype=slot_mapping.dtype)[None, :]).reshape(-1)
    # Slots past the pool (never produced by the engine) must drop, not wrap into another row.
    rows = jnp.where(jnp.repeat(slot_mapping, w) < num_pages * page_size, rows, num_pages * page_rows)
    flat = pool_slabs.reshape(num_pages * page_rows, lanes).at[rows].set(kv, mode="drop")
    return flat.reshape(pool_slabs.shape)
