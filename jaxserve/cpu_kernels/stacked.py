"""x @ w[layer] for float32 weights stacked on a layer axis, on CPUs: ``stacked_matmul.cc`` through
``jax.ffi``. The model's decode-sized steps use it inside the layer scan, where XLA would copy each
layer's weight slice before its dot (see the source's header). Built and cached like the attention
kernel (``jaxserve.cpu_kernels.build``, -march=native for the CPU it runs on)."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.cpu_kernels import build

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("stacked_matmul.cc")
# -ffp-contract=fast: a*b + c becomes one FMA where the CPU has it.
_FLAGS = ["-O3", "-march=native", "-std=c++17", "-ffp-contract=fast", "-shared", "-fPIC"]
_TARGET = "jaxserve_stacked_matmul_f32"
# The most rows the model sends through the kernel: above it XLA's dot (copy included) is faster
# per row (scripts/bench_stacked_matmul.py).
MAX_ROWS = 8


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Build (or find) and register the kernel once per process; False if that fails."""
    import ctypes

    try:
        lib = ctypes.cdll.LoadLibrary(str(build(_SOURCE, _FLAGS)))
    except (OSError, RuntimeError) as e:
        log.warning("CPU stacked matmul kernel unavailable, using XLA's dot: %s", e)
        return False
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.StackedMatmulF32), platform="cpu")
    return True


def stacked_matmul_cpu(x: jax.Array, w: jax.Array, layer: jax.Array) -> jax.Array:
    """x f32 [rows, in] @ w f32 [layers, in, out][layer] -> f32 [rows, out]; `layer` an int32 scalar
    (traced: the scan's layer index)."""
    if x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"the stacked matmul kernel takes float32 x and w; got {x.dtype}, {w.dtype}")
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"stacked matmul: x {x.shape} and w {w.shape} do not fit (x [rows, in], w [layers, in, out])")
    if not available():
        raise RuntimeError("the CPU stacked matmul kernel could not be built; see the log")
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), jnp.float32))
    return call(x, w, jnp.asarray(layer, jnp.int32))


def stacked_matmul_reference(x: np.ndarray, w: np.ndarray, layer: int) -> np.ndarray:
    return np.asarray(x, np.float64) @ np.asarray(w[layer], np.float64)
