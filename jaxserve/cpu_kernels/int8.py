"""x @ W for int8 group-quantized weights on CPUs: ``int8_matmul.cc`` through ``jax.ffi``.

Built and cached like the attention kernel (``jaxserve.cpu_kernels.build``), but without
-march=native: the library carries AVX-512, AVX2 and portable paths and picks one at run time, so
the same build serves any x86-64 CPU (and the portable path any other).
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

_SOURCE = Path(__file__).with_name("int8_matmul.cc")
# -ffp-contract=fast: a*b + c in the vector code becomes one FMA on the targets that have it.
_FLAGS = ["-O3", "-std=c++17", "-ffp-contract=fast", "-shared", "-fPIC"]
_TARGET = "jaxserve_int8_matmul_f32"
ISAS = {"auto": 0, "portable": 1, "avx2": 2, "avx512": 3}
GROUP = 32


@functools.lru_cache(maxsize=None)
def _library():
    import ctypes

    try:
        lib = ctypes.cdll.LoadLibrary(str(build(_SOURCE, _FLAGS)))
    except (OSError, RuntimeError) as e:
        log.warning("CPU int8 matmul kernel unavailable, using the XLA path: %s", e)
        return None
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.Int8MatmulF32), platform="cpu")
    return lib


def available() -> bool:
    """Build (or find) and register the kernel once per process; False if that fails."""
    return _library() is not None


def best_isa() -> str:
    """The instruction set "auto" runs on this CPU."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU int8 matmul kernel could not be built; see the log")
    code = lib.JaxserveInt8BestIsa()
    return next(name for name, c in ISAS.items() if c == code)


def int8_matmul_cpu(x: jax.Array, q: jax.Array, scales: jax.Array, *, isa: str = "auto",
                    threads: int | None = None) -> jax.Array:
    """x f32 [..., in] @ dequant(q int8 [out, in], scales f32 [out, in/32]).T -> f32 [..., out].
    isa: force a path (tests); threads: cap on the threads used (0: XLA's intra-op pool; None:
    $JAXSERVE_INT8_THREADS, else 0)."""
    if threads is None:
        threads = int(os.environ.get("JAXSERVE_INT8_THREADS", "0"))
    if x.dtype != jnp.float32 or q.dtype != jnp.int8 or scales.dtype != jnp.float32:
        raise ValueError(f"the CPU int8 kernel takes f32 x, int8 q, f32 scales; got {x.dtype}, {q.dtype}, {scales.dtype}")
    out, n_in = q.shape
    if x.shape[-1] != n_in or n_in % GROUP or scales.shape != (out, n_in // GROUP):
        raise ValueError(f"int8 matmul: x {x.shape}, q {q.shape}, scales {scales.shape} do not fit "
                         f"(in must be a multiple of {GROUP})")
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {list(ISAS)}, got {isa!r}")
    if not available():
        raise RuntimeError("the CPU int8 matmul kernel could not be built; see the log")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, n_in)
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((x2.shape[0], out), jnp.float32))
    y = call(x2, q, scales, isa=np.int32(ISAS[isa]), threads=np.int32(threads))
    return y.reshape(*lead, out)
