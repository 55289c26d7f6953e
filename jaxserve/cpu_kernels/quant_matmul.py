"""x @ W for group-quantized weights on CPUs: ``quant_matmul.cc`` through ``jax.ffi``.

Built and cached like the attention kernel (``jaxserve.cpu_kernels.build``), but without
-march=native: the library carries AVX-512, AVX2 and portable paths and picks one at run time, so
the same build serves any x86-64 CPU (and the portable path any other).

Formats (see the .cc file): int8 q without offsets (q8, GGUF Q8_0), int8 q with offsets (q8a),
packed 4-bit q as uint8 with offsets (q4a, GGUF Q4_0/Q4_1).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.cpu_kernels import build

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("quant_matmul.cc")
# -ffp-contract=fast: a*b + c in the vector code becomes one FMA on the targets that have it.
_FLAGS = ["-O3", "-std=c++17", "-ffp-contract=fast", "-shared", "-fPIC"]
# (format, scale dtype) -> (FFI target, symbol)
_TARGETS = {(fmt, sd): (f"jaxserve_{fmt}_matmul_{sd}", f"{symbol}{sd.upper()}")
            for fmt, symbol in (("q8", "Q8Matmul"), ("q8a", "Q8AffineMatmul"), ("q4a", "Q4AffineMatmul"))
            for sd in ("f32", "f16")}
_SCALE_DTYPES = {jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.float16): "f16"}
ISAS = {"auto": 0, "portable": 1, "avx2": 2, "avx512": 3}
GROUP = 32


@functools.lru_cache(maxsize=None)
def _library():
    import ctypes

    try:
        lib = ctypes.cdll.LoadLibrary(str(build(_SOURCE, _FLAGS)))
    except (OSError, RuntimeError) as e:
        log.warning("CPU quantized matmul kernel unavailable, using the XLA path: %s", e)
        return None
    for target, symbol in _TARGETS.values():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return lib


def available() -> bool:
    """Build (or find) and register the kernel once per process; False if that fails."""
    return _library() is not None


def best_isa() -> str:
    """The instruction set "auto" runs on this CPU."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU quantized matmul kernel could not be built; see the log")
    code = lib.JaxserveQuantBestIsa()
    return next(name for name, c in ISAS.items() if c == code)


def format_of(q: jax.Array, offsets: jax.Array | None) -> str:
    """The kernel format of weights q (int8 or packed 4-bit uint8), with or without offsets."""
    if q.dtype == jnp.uint8:
        if offsets is None:
            raise ValueError("packed 4-bit weights need offsets (GGUF Q4_0 is stored with offset -8 * scale)")
        return "q4a"
    if q.dtype == jnp.int8:
        return "q8" if offsets is None else "q8a"
    raise ValueError(f"quantized weights are int8 or packed 4-bit uint8; got {q.dtype}")


def quant_matmul_cpu(x: jax.Array, q: jax.Array, scales: jax.Array, offsets: jax.Array | None = None,
                     layer: jax.Array | int | None = None, *, isa: str = "auto",
                     threads: int | None = None) -> jax.Array:
    """x f32 [..., in] @ W.T -> f32 [..., out], W [out, in] given as q (int8 [out, in], or uint8
    [out, in/2] of packed 4-bit values), scales [out, in/32] and optional offsets [out, in/32],
    both float32 or both float16: w = q * scale (+ offset). Stacked weights ([layers, out, ...]
    for all three) with `layer` (an int32 scalar, traced in the model's layer scan) use that
    layer's, read in place. isa: force a path (tests); threads: cap on the threads used (0: XLA's intra-op pool;
    None: $JAXSERVE_QUANT_THREADS, else 0)."""
    if threads is None:
        threads = int(os.environ.get("JAXSERVE_QUANT_THREADS", "0"))
    fmt = format_of(q, offsets)
    if x.dtype != jnp.float32 or scales.dtype not in _SCALE_DTYPES or (
            offsets is not None and offsets.dtype != scales.dtype):
        raise ValueError(f"the CPU quantized kernel takes f32 x and float32 or float16 scales (offsets of the "
                         f"scales' dtype); got {x.dtype}, {scales.dtype}, {None if offsets is None else offsets.dtype}")
    if (q.ndim == 3) != (layer is not None) or q.ndim not in (2, 3):
        raise ValueError(f"quantized matmul: q {q.shape} takes a layer index exactly when it is stacked "
                         "[layers, out, in]")
    out, n_in = q.shape[-2], q.shape[-1] * (2 if fmt == "q4a" else 1)
    groups = (*q.shape[:-1], n_in // GROUP)
    if x.shape[-1] != n_in or n_in % GROUP or scales.shape != groups or (
            offsets is not None and offsets.shape != groups):
        raise ValueError(f"quantized matmul: x {x.shape}, q {q.shape}, scales {scales.shape}"
                         f"{'' if offsets is None else f', offsets {offsets.shape}'} do not fit "
                         f"(in must be a multiple of {GROUP})")
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {list(ISAS)}, got {isa!r}")
    if not available():
        raise RuntimeError("the CPU quantized matmul kernel could not be built; see the log")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, n_in)
    call = jax.ffi.ffi_call(_TARGETS[fmt, _SCALE_DTYPES[scales.dtype]][0],
                            jax.ShapeDtypeStruct((x2.shape[0], out), jnp.float32))
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)
    args = (x2, q, scales) if offsets is None else (x2, q, scales, offsets)
    y = call(*args, index, isa=np.int32(ISAS[isa]), threads=np.int32(threads))
    return y.reshape(*lead, out)
