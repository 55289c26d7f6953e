"""Ragged paged attention for CPUs: a C++ kernel called from XLA through ``jax.ffi``.

The CPU is where this project serves without an accelerator, and XLA's own code for paged
attention there (gathers into temporaries, many tiny batched dots) cost a third of a decode step.
The kernel (``ragged_paged_attention.cc``) has the reference's contract and is tested against it.

It is compiled on first use with the system C++ compiler against the FFI headers that jaxlib
ships, and cached under ``$JAXSERVE_CACHE_DIR/kernels`` (default ``~/.cache/jaxserve``), keyed by
the source, jaxlib's version and this CPU. Without a compiler, ``available()`` is False and the
``auto`` attention backend falls back to the XLA path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.cache_dir import cache_root

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("ragged_paged_attention.cc")
_F32, _BF16, _S8, _F8, _U8 = (jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn,
                                                     jnp.uint8))
# (q dtype, pool dtype) -> FFI target. A pool is q's dtype, or 8-bit (issue 18's KV cache, read as
# its plain float value; the caller applies the scales).
_TARGETS = {
    (_F32, _F32): "jaxserve_rpa_f32",
    (_BF16, _BF16): "jaxserve_rpa_bf16",
    (_F32, _S8): "jaxserve_rpa_f32_s8",
    (_BF16, _S8): "jaxserve_rpa_bf16_s8",
    (_F32, _F8): "jaxserve_rpa_f32_f8e4m3fn",
    (_BF16, _F8): "jaxserve_rpa_bf16_f8e4m3fn",
    (_F32, _U8): "jaxserve_rpa_f32_u8e4m3fn",  # e4m3 stored as its bytes (attention.FP8_BITS)
    (_BF16, _U8): "jaxserve_rpa_bf16_u8e4m3fn",
    (_F32, _BF16): "jaxserve_rpa_f32_bf16",
}
_SYMBOLS = {
    "jaxserve_rpa_f32": "RaggedPagedAttentionF32",
    "jaxserve_rpa_bf16": "RaggedPagedAttentionBF16",
    "jaxserve_rpa_f32_s8": "RaggedPagedAttentionF32S8",
    "jaxserve_rpa_bf16_s8": "RaggedPagedAttentionBF16S8",
    "jaxserve_rpa_f32_f8e4m3fn": "RaggedPagedAttentionF32F8E4M3FN",
    "jaxserve_rpa_bf16_f8e4m3fn": "RaggedPagedAttentionBF16F8E4M3FN",
    "jaxserve_rpa_f32_u8e4m3fn": "RaggedPagedAttentionF32U8E4M3FN",
    "jaxserve_rpa_bf16_u8e4m3fn": "RaggedPagedAttentionBF16U8E4M3FN",
    "jaxserve_rpa_f32_bf16": "RaggedPagedAttentionF32BF16",
}
# -march=native: the library is built on, and cached for, the CPU it runs on.
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC"]


def on_one_device(array: jax.Array, platform: str) -> bool:
    """Whether `array` lives on a single device of `platform` ("cpu", "tpu", ...), not a mesh."""
    sharding = getattr(array, "sharding", None)
    devices = sharding.device_set if sharding is not None else set(jax.devices()[:1])
    return len(devices) == 1 and next(iter(devices)).platform == platform


def on_one_cpu(array: jax.Array) -> bool:
    """Whether `array` lives on a single CPU device (where our kernels may replace XLA's ops)."""
    return on_one_device(array, "cpu")


def _cpu_fingerprint() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor()


def _library_path(source: Path = _SOURCE, flags: list[str] = _FLAGS) -> Path:
    import jaxlib

    key = hashlib.sha256(b"\0".join([source.read_bytes(), " ".join(flags).encode(), jaxlib.__version__.encode(),
                                     platform.machine().encode(), _cpu_fingerprint().encode()])).hexdigest()[:16]
    return cache_root() / "kernels" / f"{source.stem}-{key}.so"


def build(source: Path = _SOURCE, flags: list[str] = _FLAGS) -> Path:
    """Compile a kernel library unless a build for this source, jaxlib and CPU is cached."""
    path = _library_path(source, flags)
    if path.is_file():
        return path
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    cmd = [compiler, *flags, "-I", jax.ffi.include_dir(), str(source), "-o", str(tmp)]
    log.info("compiling a CPU kernel: %s", " ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"compiling {source.name} failed:\n{done.stderr[-4000:]}")
    os.replace(tmp, path)  # atomic: processes building at once each publish a whole file
    return path


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Build (or find) and register the kernel once per process; False if that fails."""
    import ctypes

    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
    except (OSError, RuntimeError) as e:
        log.warning("CPU attention kernel unavailable, using the XLA path: %s", e)
        return False
    for target, symbol in _SYMBOLS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return True


def ragged_paged_attention_cpu(
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
) -> jax.Array:
    """Ragged paged attention on CPU. q: [T, H, D] -> [T, H, D] in q's dtype; padding rows give zeros.

    q is float32 or bfloat16; the pool is q's dtype, int8 or float8_e4m3fn. An 8-bit pool gives
    exactly the result for ``kv_pages.astype(jnp.float32)``: any KV scales are the caller's to apply.
    """
    target = _TARGETS.get((jnp.dtype(q.dtype), jnp.dtype(kv_pages.dtype)))
    if target is None:
        raise ValueError("the CPU kernel takes float32 or bfloat16 q with a pool of q's dtype, bfloat16, int8, "
                         f"float8_e4m3fn or e4m3 bytes (uint8); got q {q.dtype}, pool {kv_pages.dtype}")
    if not available():
        raise RuntimeError("the CPU attention kernel could not be built; see the log")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, q.dtype))
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    return call(q, kv_pages, i32(kv_lens), i32(page_tables), i32(cu_q_lens), i32(num_seqs),
                sm_scale=np.float32(sm_scale), sliding_window=np.int32(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0))
