"""y = x @ dequant(q, s, m).T on TPU: group-quantized weights dequantized block by block in VMEM.

The storage is jaxserve.quantization's (unchanged): q [out, in] int8, or [out, in/2] uint8 of packed
4-bit values (a group's 16 bytes hold its elements i in the low nibble and i + 16 in the high one),
scales s [out, in/32] float32 and optional offsets m [out, in/32]. XLA fuses a bare int8 convert
into the dot but not the group scale (it writes a float copy of W per call); here each weight tile
goes HBM -> VMEM quantized and is dequantized next to the MXU.

Grid (row blocks, out blocks, k blocks); a float32 VMEM accumulator per (row, out) block. The
weights may be stacked over layers: the layer index is a prefetched scalar that the index maps
read, so one layer's tiles are fetched in place (a scan input's slice would be a copy).

The per-32 group scale has to be expanded along the lane (input) axis. Mosaic has no cheap
lane-splitting reshape, so the scales of an out block are loaded whole ([bn, in/32]: a BlockSpec's
last dim must be a multiple of 128 or the full dim, and in/32 rarely is; its block index does not
change with k, so it is fetched once per out block), and for each 128-lane chunk of the weight tile
the expanded scale is built from the chunk's 4 (8 for 4-bit) scale columns with lane-iota selects:
exact, VPU only. The scale columns are read at static lane offsets: one kernel branch per k block
(`pl.when(k == kb)`), so no dynamic lane indexing. 4-bit: the low and high nibbles of a tile are
dequantized into two VMEM tiles [bn, bk/2]; x is split the same way outside the kernel (its
elements 0..15 and 16..31 of each group), so y = x_lo @ w_lo.T + x_hi @ w_hi.T and no lane
interleave is needed in the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

GROUP = 32
LANES = 128
_CompilerParams = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")


def _pick(n: int, options: tuple[int, ...]) -> int:
    for b in options:
        if n % b == 0:
            return b
    return n  # the full dimension (a BlockSpec may always take it)


def vmem_bytes(bm: int, bn: int, bk: int, n_in: int, packed: bool, has_m: bool, itemsize: int) -> int:
    """What the pipeline holds in VMEM: double-buffered x, q, scale/offset rows and output blocks,
    the f32 accumulator, the dequantized tile(s), and room for a chunk's temporaries."""
    n_w, tk = (2, bk // 2) if packed else (1, bk)
    groups = -(-(n_in // GROUP) // LANES) * LANES
    return (2 * n_w * bm * tk * itemsize + 2 * bn * tk + 2 * (1 + has_m) * bn * groups * 4
            + 2 * bm * bn * itemsize + bm * bn * 4 + n_w * bn * tk * itemsize + 8 * bn * LANES * 4)


VMEM_BUDGET = 12 << 20  # what block_sizes aims for (the estimate below, not Mosaic's own count)
# The scoped-VMEM limit the kernel asks for: Mosaic's temporaries of the 512-row dots exceed the
# 16 MiB default (16.95 MiB at 512 x 14336 x 4096, 4-bit); every TPU since v4 has >= 32 MiB of VMEM.
VMEM_LIMIT = 32 << 20


def block_sizes(rows: int, out: int, n_in: int, packed: bool, has_m: bool = True,
                itemsize: int = 2) -> tuple[int, int, int]:
    """(bm, bn, bk) in elements: bk counts input elements (bk / 2 bytes of a packed tile).
    Rows up to 512 are one row block (decode 1-64 and prefill chunks alike: W is read and
    dequantized once per step); beyond, 256-row blocks. Tiles shrink (k first) to the VMEM budget."""
    bm = rows if rows <= 512 else 256
    bn = _pick(out, (512, 256, 128))
    ks = (4096, 2048, 1024, 512, 256) if packed else (2048, 1024, 512, 256, 128)
    bk = _pick(n_in, ks)
    while vmem_bytes(bm, bn, bk, n_in, packed, has_m, itemsize) > VMEM_BUDGET:
        smaller_k = [b for b in ks if b < bk and n_in % b == 0 and b >= 512]
        if smaller_k:
            bk = smaller_k[0]
        elif bn > 128 and bn % 256 == 0:
            bn //= 2
        else:
            break
    return bm, bn, bk


def _kernel(layer_ref, *refs, nk: int, bk: int, packed: bool, has_m: bool, precision):
    del layer_ref  # used by the index maps only
    if packed:
        xlo_ref, xhi_ref, q_ref, s_ref, *rest = refs
    else:
        x_ref, q_ref, s_ref, *rest = refs
    m_ref = rest.pop(0) if has_m else None
    o_ref, acc_ref, *w_refs = rest
    k = pl.program_id(2)
    bn = q_ref.shape[0]
    width = GROUP // 2 if packed else GROUP  # lanes of q per scale group
    tile_lanes = q_ref.shape[1]
    cdt = w_refs[0].dtype

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    def expand(ref, g0: int, n: int):
        """[bn, n * width]: column g0 + t of ref spread over lanes t*width .. (t+1)*width - 1."""
        lane = jax.lax.broadcasted_iota(jnp.int32, (bn, n * width), 1)
        out = jnp.broadcast_to(ref[:, g0:g0 + 1], (bn, n * width))
        for t in range(1, n):
            out = jnp.where(lane >= t * width, jnp.broadcast_to(ref[:, g0 + t:g0 + t + 1], (bn, n * width)), out)
        return out

    def dequant_tile(kb: int):
        groups_per_tile = tile_lanes // width
        for c0 in range(0, tile_lanes, LANES):
            cw = min(LANES, tile_lanes - c0)
            g0 = kb * groups_per_tile + c0 // width
            n = cw // width
            scale = expand(s_ref, g0, n)
            offset = expand(m_ref, g0, n) if has_m else None
            v = q_ref[:, c0:c0 + cw].astype(jnp.int32)
            parts = ((v & 15), ((v >> 4) & 15)) if packed else (v,)
            for w_ref, p in zip(w_refs, parts):
                w = p.astype(jnp.float32) * scale
                if has_m:
                    w = w + offset
                w_ref[:, c0:c0 + cw] = w.astype(cdt)

    def step(kb: int):
        dequant_tile(kb)
        nt = (((1,), (1,)), ((), ()))
        xs = (xlo_ref, xhi_ref) if packed else (x_ref,)
        total = None
        for xr, w_ref in zip(xs, w_refs):
            d = jax.lax.dot_general(xr[...].astype(cdt), w_ref[...], nt, precision=precision,
                                    preferred_element_type=jnp.float32)
            total = d if total is None else total + d
        acc_ref[...] += total

    if nk == 1:
        step(0)
    else:
        for kb in range(nk):
            pl.when(k == kb)(functools.partial(step, kb))

    @pl.when(k == nk - 1)
    def _store():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "block"))
def quant_matmul_tpu(x: jax.Array, q: jax.Array, s: jax.Array, m: jax.Array | None = None,
                     layer: jax.Array | None = None, *, interpret: bool = False,
                     block: tuple[int, int, int] | None = None) -> jax.Array:
    """x [rows, in] @ dequant(q, s, m).T -> [rows, out] in x's dtype (float32 accumulation).
    q int8 [out, in] (s, optional m) or uint8 [out, in/2] packed 4-bit (s and m). layer: q, s, m
    carry a leading layer axis and this (traced) index picks one; the index maps read it (scalar
    prefetch), so the layer's tiles are fetched in place, never sliced out into a copy."""
    if layer is None:
        q, s, m = q[None], s[None], None if m is None else m[None]
        layer = 0
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    packed = q.dtype == jnp.uint8
    rows, n_in = x.shape
    out = q.shape[1]
    if (q.shape[2] * (2 if packed else 1)) != n_in or s.shape != (q.shape[0], out, n_in // GROUP) or n_in % GROUP:
        raise ValueError(f"quant_matmul_tpu: x {x.shape}, q {q.dtype}{q.shape}, s {s.shape} do not fit")
    if packed and m is None:
        raise ValueError("packed 4-bit weights need offsets")
    bm, bn, bk = block or block_sizes(rows, out, n_in, packed, m is not None, jnp.dtype(x.dtype).itemsize)
    if out % bn or n_in % bk or bk % GROUP:
        raise ValueError(f"quant_matmul_tpu: blocks {(bm, bn, bk)} do not tile out {out} / in {n_in}")
    nk = n_in // bk
    # bf16 activations: bf16 weights on the MXU (f32 accumulation); f32 ones stay f32.
    cdt = jnp.float32 if x.dtype == jnp.float32 else jnp.bfloat16
    precision = jax.lax.Precision.HIGHEST if cdt == jnp.float32 else None
    grid = (pl.cdiv(rows, bm), out // bn, nk)
    tk = bk // 2 if packed else bk  # lanes of a q tile (and of each x half)
    x_spec = pl.BlockSpec((bm, tk), lambda i, j, k, l: (i, k))
    w_spec = pl.BlockSpec((None, bn, tk), lambda i, j, k, l: (l[0], j, k))
    g_spec = pl.BlockSpec((None, bn, n_in // GROUP), lambda i, j, k, l: (l[0], j, 0))  # whole rows of groups
    if packed:
        xg = x.reshape(rows, n_in // GROUP, 2, GROUP // 2)
        xs = (xg[:, :, 0].reshape(rows, n_in // 2), xg[:, :, 1].reshape(rows, n_in // 2))
        in_specs, args = [x_spec, x_spec, w_spec, g_spec], [*xs, q, s]
    else:
        in_specs, args = [x_spec, w_spec, g_spec], [x, q, s]
    if m is not None:
        in_specs.append(g_spec)
        args.append(m)
    n_w = 2 if packed else 1
    scratch = [pltpu.VMEM((bm, bn), jnp.float32)] + [pltpu.VMEM((bn, tk), cdt)] * n_w
    vmem = vmem_bytes(bm, bn, bk, n_in, packed, m is not None, max(jnp.dtype(x.dtype).itemsize, 2))
    params = _CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                             vmem_limit_bytes=VMEM_LIMIT if vmem <= VMEM_BUDGET else int(vmem * 2))
    kernel = functools.partial(_kernel, nk=nk, bk=bk, packed=packed, has_m=m is not None, precision=precision)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=grid,
            in_specs=in_specs,
            out_specs=pl.BlockSpec((bm, bn), lambda i, j, k, l: (i, j)),
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct((rows, out), x.dtype),
        compiler_params=None if interpret else params,
        interpret=interpret,
    )(layer, *args)
