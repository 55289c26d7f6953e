"""GPU compile check without a GPU: our Pallas GPU kernels compiled for H200 (sm_90a) by real
compilers, over the shapes of every architecture we load.

Two routes, the first one available wins for the matrix:
  * XLA's own GPU compiler (the real thing): jax's CUDA PJRT plugin, installed --no-deps beside
    the venv (``scripts/install_xla_cuda.sh``), compiles deviceless against a GPU target config
    (``jax.experimental.topologies.get_topology_desc(platform="cuda", topology="1x1x1",
    target_config=H200 spec)``): StableHLO -> XLA GPU passes -> its bundled Triton for our
    ``__gpu$xla.gpu.triton`` custom calls -> PTX -> ptxas (found under /usr/local/cuda). Shared
    memory per kernel is read from XLA's thunk sequence, tensor-core instructions from its PTX. It
    runs in a subprocess (the plugin must be on the path before jax starts; the suite stays CPU-only).
  * The ``triton`` wheel (``.[compile-gpu]``): the Triton IR Pallas emits, compiled by Triton 3.9
    (TTIR -> TTGIR -> LLVM -> PTX -> its bundled ptxas). A close proxy for XLA's bundled Triton.
Either way: compiles, fits 227 KB of shared memory per block, within our estimate (an upper bound
within ~2 KB), bf16 prefill on Hopper's wgmma. 8-bit pools (int8, float8_e4m3fn) are in the matrix
too: 1-byte loads upcast to f32 tiles (FMA); fp8 before sm_89 is refused up front. Without either package the matrix skips with the
install command as the reason. ``python tests/test_gpu_compile.py`` prints the matrix as a table.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest

# A fresh cache: every run compiles for real (a warm ~/.triton cache would hide compiler changes).
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="jaxserve-triton-"))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated to silence its warning

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxserve.pallas_kernels.ragged_paged_attention_gpu import (  # noqa: E402
    _MAX_POOL_ELEMENTS, _fit_blocks, aot_target, gpu_blocks_for, kv_compute_dtype, ragged_paged_attention_gpu,
    shared_bytes_estimate, uses_wgmma,
)

SKIP_REASON = "GPU compile check needs the triton package: pip install -e '.[compile-gpu]'"
TARGET = "NVIDIA H200"
HOPPER = gpu_blocks_for(TARGET)


@dataclass(frozen=True)
class Shape:
    name: str
    kv_heads: int
    group: int
    head_dim: int
    page_size: int
    dtype: str
    tokens: int = 512  # the engine's largest token bucket (max_num_batched_tokens default)
    seqs: int = 64  # its sequence cap (max_num_seqs default)
    pages_per_seq: int = 128  # max_model_len 2048 / page 16
    sliding_window: int | None = None
    soft_cap: float | None = None
    kv_dtype: str | None = None  # the pool's dtype when it differs from q's (8-bit pools)

    @property
    def id(self) -> str:
        kv = f"_kv_{self.kv_dtype}" if self.kv_dtype else ""
        return f"{self.name}_d{self.head_dim}_ps{self.page_size}_{self.dtype}{kv}"

    @property
    def compute_itemsize(self) -> int:
        """Bytes per element of the tiles the dots use (8-bit pools are upcast to f32)."""
        return kv_compute_dtype(self.kv_dtype or self.dtype).itemsize

    @property
    def load_itemsize(self) -> int:
        """Bytes per element of the pool as loaded."""
        return jnp.dtype(self.kv_dtype or self.dtype).itemsize


# Every architecture we load at its real head shapes; head_dim 64/128/256, bf16 and f32, pages
# 16/32/64, the engine's largest buckets (8K context for the 8B shapes). f32 compiles ~5x slower
# (FMA tiles), so it appears where it adds a distinct case (d64 default model, d128, d256 clamp).
MATRIX = [
    Shape("smollm2", 3, 3, 64, 16, "float32"),  # the default model as served (9 q / 3 KV heads)
    Shape("smollm2", 3, 3, 64, 16, "bfloat16"),
    Shape("llama3_8b", 8, 4, 128, 16, "bfloat16", pages_per_seq=512),
    Shape("llama3_8b", 8, 4, 128, 32, "bfloat16", pages_per_seq=256),
    Shape("llama3_8b", 8, 4, 128, 64, "bfloat16", pages_per_seq=128),
    Shape("llama3_8b", 8, 4, 128, 16, "float32", pages_per_seq=512),
    Shape("qwen2_7b", 4, 7, 128, 16, "bfloat16", pages_per_seq=512),  # group 7: padded rows
    Shape("qwen3_0.6b", 8, 2, 128, 32, "bfloat16"),
    Shape("mistral_7b", 8, 4, 128, 16, "bfloat16", pages_per_seq=512, sliding_window=4096),
    Shape("gemma_like", 4, 2, 256, 16, "bfloat16", soft_cap=50.0),
    Shape("gemma_like", 4, 2, 256, 16, "float32", soft_cap=50.0),  # default blocks clamp to fit
    # 8-bit pools (--kv-cache-dtype), bf16 q: 1-byte loads upcast to f32 tiles
    Shape("smollm2", 3, 3, 64, 16, "bfloat16", kv_dtype="int8"),
    Shape("smollm2", 3, 3, 64, 16, "bfloat16", kv_dtype="float8_e4m3fn"),
    Shape("llama3_8b", 8, 4, 128, 16, "bfloat16", pages_per_seq=512, kv_dtype="int8"),
    Shape("llama3_8b", 8, 4, 128, 16, "bfloat16", pages_per_seq=512, kv_dtype="float8_e4m3fn"),
    Shape("gemma_like", 4, 2, 256, 16, "bfloat16", soft_cap=50.0, kv_dtype="int8"),  # block_kv shrinks to fit
]
CLAMP_SHAPE = next(m for m in MATRIX if m.head_dim == 256 and m.dtype == "float32")


def _args(s: Shape) -> tuple[jax.ShapeDtypeStruct, ...]:
    dtype = jnp.dtype(s.dtype)
    per_page = s.page_size * 2 * s.kv_heads * s.head_dim
    num_pages = min(_MAX_POOL_ELEMENTS // per_page, 1 << 20)  # the largest pool the kernels address
    sds = jax.ShapeDtypeStruct
    return (sds((s.tokens, s.kv_heads * s.group, s.head_dim), dtype),
            sds((num_pages, s.page_size, 2 * s.kv_heads, s.head_dim), jnp.dtype(s.kv_dtype or s.dtype)),
            sds((s.seqs,), jnp.int32), sds((s.seqs, s.pages_per_seq), jnp.int32),
            sds((s.seqs + 1,), jnp.int32), sds((1,), jnp.int32))


def triton_modules(fn: Any, args: tuple, kw: dict, device_kind: str = TARGET) -> list[dict[str, Any]]:
    """Lower fn for CUDA and return each pallas_call's Triton module (generic MLIR text) with
    the num_warps / num_stages XLA would compile it with."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    captured: list[str] = []
    orig = reg.lowering.lower_jaxpr_to_triton_module

    def capture(*a: Any, **k: Any) -> Any:
        res = orig(*a, **k)
        captured.append(res.module.operation.get_asm(print_generic_op_form=True))
        return res

    reg.lowering.lower_jaxpr_to_triton_module = capture  # the one seam both jax 0.10 and 0.11 call
    try:
        with aot_target(device_kind):
            text = jax.jit(functools.partial(fn, **kw)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = orig
    configs = re.findall(r"num_stages = (\d+) : i32, num_warps = (\d+) : i32", text)
    assert len(configs) == len(captured), (len(configs), len(captured))
    return [dict(name=re.search(r'sym_name = "([^"]+)"', m).group(1), ttir=m, num_stages=int(st), num_warps=int(w))
            for m, (st, w) in zip(captured, configs)]


def compile_for_cuda(ttir: str, num_warps: int, num_stages: int, cc: int = 90) -> dict[str, Any]:
    """Triton's own compiler for compute capability cc: shared bytes, tensor-core instructions."""
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.NamedTemporaryFile("w", suffix=".ttir", delete=False) as f:
        f.write(ttir)
    t0 = time.perf_counter()
    try:
        kernel = triton.compile(f.name, target=GPUTarget("cuda", cc, 32),
                                options=dict(num_warps=num_warps, num_stages=num_stages))
    finally:
        os.unlink(f.name)
    ptx = kernel.asm["ptx"]
    return dict(shared=int(kernel.metadata.shared), wgmma=ptx.count("wgmma.mma_async"),
                mma_sync=ptx.count("mma.sync"), cubin_bytes=len(kernel.asm["cubin"]),
                seconds=time.perf_counter() - t0)


def compile_shape(s: Shape, **extra: Any) -> list[dict[str, Any]]:
    kw = dict(sm_scale=s.head_dim ** -0.5, sliding_window=s.sliding_window, soft_cap=s.soft_cap, **extra)
    out = []
    for mod in triton_modules(ragged_paged_attention_gpu, _args(s), kw):
        res = compile_for_cuda(mod["ttir"], mod["num_warps"], mod["num_stages"])
        out.append({**mod, **res})
    return out


# H200 as XLA's GpuTargetConfigProto (text format): what a deviceless compile targets. Figures from
# NVIDIA's H100/H200 SXM specifications (132 SMs, 227 KB opt-in shared memory per block, 50 MB L2).
H200_TARGET_CONFIG = """gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 150754820096 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
device_description_str: "NVIDIA H200"
"""
XLA_SKIP_REASON = ("XLA's deviceless GPU compile needs jax's CUDA plugin beside the venv: "
                   "bash scripts/install_xla_cuda.sh (and ptxas, e.g. /usr/local/cuda/bin)")


def xla_plugin_dir() -> Path | None:
    """Where scripts/install_xla_cuda.sh put jax-cuda13-plugin/-pjrt for this jaxlib, if it did."""
    import jaxlib

    path = Path(os.environ.get("JAXSERVE_XLA_CUDA_DIR", Path(sys.prefix) / "xla-cuda" / jaxlib.__version__))
    # XLA turns PTX into cubins with ptxas (no driver fallback): without one, use the triton route.
    has_ptxas = shutil.which("ptxas") is not None or Path("/usr/local/cuda/bin/ptxas").exists()
    return path if (path / "jax_plugins").is_dir() and has_ptxas else None


def xla_compile_worker(shape_ids: list[str], out: Path) -> None:
    """(Subprocess, plugin on sys.path.) Compile each shape through XLA for the H200 target."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(topology_name="", platform="cuda", topology="1x1x1",
                                        target_config=H200_TARGET_CONFIG)
    mesh = jax.sharding.Mesh(topo.devices[:1], ("x",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    results = {}
    for sid in shape_ids:
        s = next(m for m in MATRIX if m.id == sid)
        dump = Path(tempfile.mkdtemp(prefix=f"xla-{sid}-"))
        kw = dict(sm_scale=s.head_dim ** -0.5, sliding_window=s.sliding_window, soft_cap=s.soft_cap,
                  device_kind=TARGET)
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep) for a in _args(s)]
        fn = jax.jit(functools.partial(ragged_paged_attention_gpu, **kw), in_shardings=(rep,) * 6, out_shardings=rep)
        t0 = time.perf_counter()
        try:
            # jax >= 0.11 reads the Pallas GPU target from the ambient mesh's device: the H200 topology's.
            with (jax.set_mesh(mesh) if hasattr(jax, "set_mesh") else contextlib.nullcontext()):
                lowered = fn.lower(*args)
            compiled = lowered.compile({"xla_dump_to": str(dump)})
            del compiled
            results[sid] = dict(seconds=time.perf_counter() - t0, **_parse_xla_dump(dump))
        except Exception as e:  # noqa: BLE001 - reported per shape to the parent test
            results[sid] = dict(error=f"{type(e).__name__}: {e}"[:3000])
        out.write_text(json.dumps(results))


def _parse_xla_dump(dump: Path) -> dict[str, Any]:
    """Shared memory of our kernels from XLA's thunk sequence; wgmma / mma.sync from its PTX."""
    kernels: dict[str, dict[str, Any]] = {}
    for f in dump.glob("*thunk_sequence.txt"):
        for name, shared in re.findall(r"(jaxserve_rpa_\w+) grid: .*?shared_memory: (\d+) bytes", f.read_text()):
            kernels.setdefault(name, {})["shared"] = int(shared)
    for f in dump.glob("*.ptx"):
        text = f.read_text()
        for name in re.findall(r"\.entry (jaxserve_rpa_\w+)\(", text):
            k = kernels.setdefault(name, {})
            k["wgmma"] = k.get("wgmma", 0) + text.count("wgmma.mma_async")
            k["mma_sync"] = k.get("mma_sync", 0) + text.count("mma.sync")
    return dict(kernels=kernels)


_SELECTED: list[str] = []  # shape ids of the tests pytest selected (set by the fixture below)


@functools.lru_cache(maxsize=1)
def xla_results() -> dict[str, Any]:
    """The selected shapes (all of MATRIX outside pytest) compiled by XLA in one subprocess,
    so the plugin loads once and ``-k`` also shortens the compile."""
    plugin = xla_plugin_dir()
    assert plugin is not None
    ids = _SELECTED or [m.id for m in MATRIX]
    if MATRIX[2].id not in ids:
        ids.append(MATRIX[2].id)  # test_triton_wheel_agrees_with_xla's shape
    out = Path(tempfile.mkdtemp(prefix="xla-gpu-compile-")) / "results.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin), os.environ.get("PYTHONPATH", "")]),
           "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run([sys.executable, __file__, "--xla-worker", str(out)] + ids, env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 and not out.exists():
        raise RuntimeError(f"XLA compile worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def expected_blocks(s: Shape, kernel: str) -> tuple[int, int, bool]:
    """(rows, block_kv, wgmma) the kernel picks for this shape on the target, by its own rule."""
    itemsize = s.compute_itemsize
    g_pad = max(16, 1 << (s.group - 1).bit_length())
    bq, bkv = _fit_blocks(rows_decode=g_pad, block_q=None, block_kv=None, head_dim=s.head_dim, itemsize=itemsize,
                          num_warps=HOPPER.num_warps, blocks=HOPPER, kind=TARGET, dtype_name=s.dtype, kv_from="",
                          load_itemsize=s.load_itemsize)
    rows = g_pad if "decode" in kernel else bq
    return rows, bkv, "prefill" in kernel and uses_wgmma(rows, itemsize, HOPPER.num_warps, HOPPER.cc)


@pytest.fixture(scope="module", autouse=True)
def _selected_shapes(request):
    params = [getattr(getattr(item, "callspec", None), "params", {}) for item in request.session.items]
    _SELECTED[:] = [p["shape"].id for p in params if isinstance(p.get("shape"), Shape)]
    if any("clamp" in item.name for item in request.session.items):
        _SELECTED.append(CLAMP_SHAPE.id)  # test_default_blocks_clamp_to_fit's shape


def _have_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def compiled_kernels(shape: Shape) -> tuple[str, list[dict[str, Any]]]:
    """(route, per-kernel results) for a shape: XLA's compiler if its plugin is there, else the
    triton wheel, else a skip naming both installs."""
    if xla_plugin_dir() is not None:
        res = xla_results()[shape.id]
        if "error" in res:
            pytest.fail(f"XLA GPU compile failed for {shape.id}: {res['error']}")
        mods = {m["name"]: m for m in triton_modules(ragged_paged_attention_gpu, _args(shape),
                                                     dict(sm_scale=shape.head_dim ** -0.5,
                                                          sliding_window=shape.sliding_window,
                                                          soft_cap=shape.soft_cap))}
        return "xla", [{**mods[name], **k, "seconds": res["seconds"]} for name, k in sorted(res["kernels"].items())]
    if _have_triton():
        return "triton", compile_shape(shape)
    pytest.skip(f"{XLA_SKIP_REASON}; or {SKIP_REASON}")


@pytest.mark.parametrize("shape", MATRIX, ids=lambda s: s.id)
def test_kernels_compile_for_sm90(shape: Shape):
    """Both kernels compile, fit H100/H200 shared memory, within our estimate; bf16 prefill on wgmma."""
    route, mods = compiled_kernels(shape)
    assert sorted(m["name"] for m in mods) == ["jaxserve_rpa_decode", "jaxserve_rpa_prefill"]
    itemsize = shape.compute_itemsize
    for m in mods:
        print(f"[{route}] {shape.id} {m['name']}: {m['shared']} B shared, wgmma {m.get('wgmma')}, "
              f"mma.sync {m.get('mma_sync')}, {m['seconds']:.1f} s")
        assert 0 < m["shared"] <= HOPPER.shared_bytes, m["shared"]
        rows, block_kv, wgmma = expected_blocks(shape, m["name"])
        assert f"tensor<{block_kv}x{shape.head_dim}x!tt.ptr" in m["ttir"]  # K/V tiles of the size we think
        assert f"tensor<{rows}x{shape.head_dim}x!tt.ptr" in m["ttir"]  # the query tile
        est = shared_bytes_estimate(rows, block_kv, shape.head_dim, itemsize, wgmma, shape.load_itemsize)
        assert est >= m["shared"], (m["name"], est, m["shared"])  # the estimate is an upper bound ...
        assert est <= 1.05 * m["shared"] + 2048, (m["name"], est, m["shared"])  # ... and a tight one
    prefill = next(m for m in mods if "prefill" in m["name"])
    if "wgmma" not in prefill:  # XLA of jax 0.11 dumps no PTX; test_triton_wheel_agrees_with_xla covers it
        return
    if itemsize == 2:
        assert prefill["wgmma"] > 0 and prefill["mma_sync"] == 0, "Hopper bf16 prefill should reach wgmma"
    else:
        assert prefill["wgmma"] == 0  # f32 at HIGHEST precision: FMA, no TF32 tensor cores


def test_triton_wheel_agrees_with_xla():
    """The proxy and the real compiler allocate the same shared memory (one Llama-3 bf16 shape)."""
    if xla_plugin_dir() is None or not _have_triton():
        pytest.skip(f"needs both compilers: {XLA_SKIP_REASON}; {SKIP_REASON}")
    s = MATRIX[2]
    xla = {n: k for n, k in xla_results()[s.id]["kernels"].items()}
    for m in compile_shape(s):
        assert abs(m["shared"] - xla[m["name"]]["shared"]) <= 1024, (m["name"], m["shared"], xla[m["name"]])
        if "wgmma" in xla[m["name"]]:
            assert (m["wgmma"] > 0) == (xla[m["name"]]["wgmma"] > 0), m["name"]


def test_oversized_explicit_blocks_fail_before_compiling():
    """pages_per_block x page_size past 227 KB of tiles: a ValueError naming the setting, no compiler."""
    s = MATRIX[2]  # Llama-3-8B bf16, page 16
    # 512 slots: ~405 KB for the decode tile alone (block_q cannot shrink it); 256 slots would
    # still fit by shrinking the unset block_q (64 -> 16) for the prefill tile.
    kw = dict(sm_scale=0.1, pages_per_block=32)
    with aot_target(TARGET), pytest.raises(ValueError, match=r"pages_per_block=32 x page_size=16.*227 KB"):
        jax.jit(functools.partial(ragged_paged_attention_gpu, **kw)).trace(*_args(s)).lower(lowering_platforms=("cuda",))


def test_default_blocks_clamp_to_fit():
    """head_dim 256 f32 does not fit at the table's block_kv: the default shrinks it to the largest
    power of two that fits, and compiles."""
    s = CLAMP_SHAPE
    assert shared_bytes_estimate(HOPPER.block_q_f32, HOPPER.block_kv, 256, 4, False) > HOPPER.shared_bytes
    bkv = expected_blocks(s, "prefill")[1]
    assert bkv < HOPPER.block_kv
    assert shared_bytes_estimate(HOPPER.block_q_f32, bkv, 256, 4, False) <= HOPPER.shared_bytes
    assert shared_bytes_estimate(HOPPER.block_q_f32, 2 * bkv, 256, 4, False) > HOPPER.shared_bytes
    prefill = next(m for m in compiled_kernels(s)[1] if "prefill" in m["name"])
    assert f"tensor<{bkv}x256x!tt.ptr" in prefill["ttir"]
    assert prefill["shared"] <= HOPPER.shared_bytes


def test_fp8_pool_before_sm89_is_a_clear_error():
    """Triton cannot convert fp8 on sm_80 (it aborts: "LLVM ERROR: Conversion from/to f8e4m3nv is only
    supported on compute capability >= 89"): an fp8 pool on an A100 is refused while tracing; int8
    is fine there, and fp8 on sm_89+ (checked by the matrix for sm_90)."""
    s = next(m for m in MATRIX if m.kv_dtype == "float8_e4m3fn")
    lower = jax.jit(functools.partial(ragged_paged_attention_gpu, sm_scale=0.1)).trace
    with aot_target("NVIDIA A100-SXM4-80GB"):
        with pytest.raises(ValueError, match="float8_e4m3fn KV pool needs compute capability >= 8.9"):
            lower(*_args(s)).lower(lowering_platforms=("cuda",))
        int8 = [jax.ShapeDtypeStruct(a.shape, jnp.int8) if i == 1 else a for i, a in enumerate(_args(s))]
        lower(*int8).lower(lowering_platforms=("cuda",))
    with aot_target("NVIDIA L4"):
        lower(*_args(s)).lower(lowering_platforms=("cuda",))


def test_pool_past_int32_offsets_is_a_clear_error():
    s = MATRIX[2]
    args = list(_args(s))
    args[1] = jax.ShapeDtypeStruct((70000,) + args[1].shape[1:], args[1].dtype)  # > 2^31 elements
    with aot_target(TARGET), pytest.raises(ValueError, match="int32 offsets.*num_pages"):
        jax.jit(functools.partial(ragged_paged_attention_gpu, sm_scale=0.1)).trace(*args).lower(
            lowering_platforms=("cuda",))


def main() -> None:
    """Print the compile matrix as a markdown table (for docs/kernels.md)."""
    if len(sys.argv) > 2 and sys.argv[1] == "--xla-worker":
        xla_compile_worker(sys.argv[3:], Path(sys.argv[2]))
        return
    print("| shape | heads q/kv | head_dim | page | dtype | kernel | rows x block_kv | shared KB (XLA) "
          "| shared KB (triton 3.9) | estimate KB | tensor cores | 227 KB limit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    xla = xla_results() if xla_plugin_dir() is not None else {}
    for s in MATRIX:
        tri = {m["name"]: m for m in compile_shape(s)} if _have_triton() else {}
        for name in ("jaxserve_rpa_decode", "jaxserve_rpa_prefill"):
            x = xla.get(s.id, {}).get("kernels", {}).get(name, {})
            t = tri.get(name, {})
            rows, kv, wg = expected_blocks(s, name)
            est = shared_bytes_estimate(rows, kv, s.head_dim, s.compute_itemsize, wg, s.load_itemsize)
            src = x or t
            tc = "wgmma" if src.get("wgmma") else ("mma.sync" if src.get("mma_sync") else "none (FMA)")
            fits = max(x.get("shared", 0), t.get("shared", 0)) <= HOPPER.shared_bytes
            kb = lambda d: f"{d['shared'] / 1024:.1f}" if "shared" in d else "-"  # noqa: E731
            dt = s.dtype + (f" (kv {s.kv_dtype})" if s.kv_dtype else "")
            print(f"| {s.name} | {s.kv_heads * s.group}/{s.kv_heads} | {s.head_dim} | {s.page_size} | {dt} "
                  f"| {name[13:]} | {rows}x{kv} | {kb(x)} | {kb(t)} | {est / 1024:.1f} | {tc} "
                  f"| {'pass' if fits else 'FAIL'} |", flush=True)


if __name__ == "__main__":
    main()
