"""Ragged paged attention: the XLA reference against dense float64 numpy, and the XLA serving path,
the C++ CPU kernel and the Pallas kernel (interpret mode) against the reference, on mixed decode +
prefill batches."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve.attention import FP8_BITS, ragged_paged_attention_split, ragged_paged_attention_xla, write_kv
from jaxserve.cpu_kernels import ragged_paged_attention_cpu
from jaxserve.pallas_kernels import ragged_paged_attention_gpu


def make_case(seed: int, q_heads: int, kv_heads: int, head_dim: int, page_size: int, specs, dtype=jnp.float32):
    """specs: (q_len, kv_len) per sequence. Pages in random order, never page 0; unused pages hold garbage."""
    rng = np.random.default_rng(seed)
    pages_needed = [-(-kv // page_size) for _, kv in specs]
    num_pages = 1 + sum(pages_needed) + 5
    width = max(1, max(pages_needed))
    pool = rng.normal(size=(num_pages, page_size, 2 * kv_heads, head_dim)).astype(np.float32) * 3
    perm = rng.permutation(np.arange(1, num_pages))
    tables = np.zeros((len(specs) + 2, width), np.int32)  # two padding sequence rows
    k = 0
    for i, n in enumerate(pages_needed):
        tables[i, :n] = perm[k: k + n]
        k += n
    cu = np.zeros(len(specs) + 3, np.int32)
    cu[1: len(specs) + 1] = np.cumsum([q for q, _ in specs])
    cu[len(specs) + 1:] = cu[len(specs)]
    num_tokens = int(cu[-1]) + 3  # padding rows
    q = rng.normal(size=(num_tokens, q_heads, head_dim)).astype(np.float32)
    k_new = rng.normal(size=(num_tokens, kv_heads, head_dim)).astype(np.float32)
    v_new = rng.normal(size=(num_tokens, kv_heads, head_dim)).astype(np.float32)
    slots = []
    for i, (ql, kv) in enumerate(specs):
        slots += [tables[i, p // page_size] * page_size + p % page_size for p in range(kv - ql, kv)]
    slots += [0] * 3  # padding writes into the null page
    kv_lens = np.zeros(len(specs) + 2, np.int32)
    kv_lens[: len(specs)] = [kv for _, kv in specs]
    pool = write_kv(jnp.asarray(pool, dtype), jnp.asarray(k_new, dtype), jnp.asarray(v_new, dtype), jnp.asarray(slots))
    args = (jnp.asarray(q, dtype), pool, jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(cu),
            jnp.asarray([len(specs)], jnp.int32))
    return args, jnp.asarray(k_new, dtype), jnp.asarray(v_new, dtype)


def with_8bit_pool(args, q_dtype, kv_dtype, seed: int):
    """The case with its pool replaced by random 8-bit values over the dtype's whole range (NaN
    aside) and q scaled down as a caller folds a K scale into it, so that scores stay O(1)."""
    q, pool, *rest = args
    raw = np.random.default_rng(seed).integers(0, 256, pool.shape, dtype=np.uint8)
    if jnp.dtype(kv_dtype) == jnp.int8:
        values, k_scale = raw.view(np.int8), 1 / 64
    else:
        raw[(raw & 0x7F) == 0x7F] = 0  # e4m3fn's two NaN bytes
        values, k_scale = raw.view(ml_dtypes.float8_e4m3fn), 1 / 128
    return (jnp.asarray(q * k_scale, q_dtype), jnp.asarray(values), *rest)


def dense_reference(args, sm_scale, sliding_window=None, soft_cap=None) -> np.ndarray:
    q, pool, kv_lens, tables, cu, num_seqs = (np.asarray(a, np.float64) if i < 2 else np.asarray(a)
                                              for i, a in enumerate(args))
    out = np.zeros_like(q)
    kvh = pool.shape[2] // 2
    group = q.shape[1] // kvh
    for s in range(int(num_seqs[0])):
        kv = pool[tables[s]].reshape(-1, pool.shape[2], pool.shape[3])[: kv_lens[s]]
        ql = cu[s + 1] - cu[s]
        for i in range(ql):
            pos = kv_lens[s] - ql + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(q.shape[1]):
                k, v = kv[lo: pos + 1, 2 * (h // group)], kv[lo: pos + 1, 2 * (h // group) + 1]
                sc = k @ q[cu[s] + i, h] * sm_scale
                if soft_cap is not None:
                    sc = soft_cap * np.tanh(sc / soft_cap)
                p = np.exp(sc - sc.max())
                out[cu[s] + i, h] = (p / p.sum()) @ v
    return out


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


# (q heads, kv heads, head_dim, page size, sequences as (q_len, kv_len))
CASES = [
    (4, 4, 64, 8, [(1, 1), (1, 7), (1, 8), (1, 9), (5, 5), (3, 30)]),  # MHA, lengths around a page
    (8, 2, 128, 16, [(1, 15), (1, 16), (1, 17), (16, 16), (9, 40), (1, 200)]),  # GQA 4, long decode
    (8, 1, 64, 32, [(1, 33), (20, 20), (7, 70)]),  # MQA
    (8, 8, 64, 64, [(1, 64), (2, 65), (1, 1)]),  # page size 64
    (9, 3, 64, 16, [(12, 12), (1, 50), (4, 36)]),  # SmolLM2's heads, GQA 3
    (16, 2, 64, 8, [(1, 3), (6, 6)]),  # GQA 8
    (4, 2, 256, 16, [(1, 20), (9, 40), (1, 1)]),  # Gemma's head_dim 256 (the C++ kernel's generic D path)
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_reference_matches_dense_float64(case):
    args, _, _ = make_case(case, *CASES[case])
    for window, cap in ((None, None), (5, None), (None, 4.0)):
        ours = ragged_paged_attention_xla(*args, sm_scale=0.125, sliding_window=window, soft_cap=cap)
        assert rel(ours, dense_reference(args, 0.125, window, cap)) <= 1e-5
        assert float(jnp.abs(ours[-3:]).max()) == 0.0  # padding rows


@pytest.mark.parametrize("case", range(len(CASES)))
def test_serving_path_matches_reference(case):
    args, k_new, v_new = make_case(100 + case, *CASES[case])
    for window, cap in ((None, None), (5, None), (None, 4.0)):
        ref = ragged_paged_attention_xla(*args, sm_scale=0.125, sliding_window=window, soft_cap=cap)
        ours = ragged_paged_attention_split(*args, k_new=k_new, v_new=v_new, sm_scale=0.125,
                                            sliding_window=window, soft_cap=cap)
        assert rel(ours, ref) <= 1e-5


@pytest.mark.parametrize("case", range(len(CASES)))
def test_pallas_gpu_kernel_interpret_matches_reference(case):
    args, _, _ = make_case(200 + case, *CASES[case])
    for window, cap in ((None, None), (5, 4.0)):
        ref = ragged_paged_attention_xla(*args, sm_scale=0.125, sliding_window=window, soft_cap=cap)
        ours = ragged_paged_attention_gpu(*args, sm_scale=0.125, sliding_window=window, soft_cap=cap,
                                          pages_per_block=2, num_splits=2, interpret=True)
        assert rel(ours, ref) <= 1e-5


# (q dtype, pool dtype): the float32 pool, and an 8-bit pool of each kind with each q dtype once;
# test_cpu_kernel_8bit_pool_is_its_float32_value covers the other two pairs.
POOLS = [("float32", "float32"), ("float32", "int8"), ("bfloat16", "float8_e4m3fn")]


@pytest.mark.parametrize("pool", POOLS, ids="/".join)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_cpu_kernel_matches_reference(case, pool):
    args, _, _ = make_case(300 + case, *CASES[case])
    options = ((None, None), (5, None), (None, 4.0), (3, 4.0))
    if pool[1] != "float32":  # the 8-bit pools only change how K and V are read: fewer options
        args, options = with_8bit_pool(args, *pool, seed=case), ((None, None), (3, 4.0))
    # bfloat16 output: both sides round the same float32 result, at most one bfloat16 ulp apart.
    tol = 1e-5 if pool[0] == "float32" else 2.0 ** -7
    for window, cap in options:
        ref = ragged_paged_attention_xla(*args, sm_scale=0.125, sliding_window=window, soft_cap=cap)
        ours = jax.jit(lambda *a: ragged_paged_attention_cpu(*a, sm_scale=0.125, sliding_window=window,
                                                             soft_cap=cap))(*args)
        assert ours.dtype == args[0].dtype
        assert rel(ours, ref) <= tol
        assert float(jnp.abs(ours[-3:]).max()) == 0.0  # padding rows


@pytest.mark.parametrize("q_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_cpu_kernel_8bit_pool_is_its_float32_value(q_dtype, kv_dtype):
    """The contract: an 8-bit pool gives bit for bit the result of pool.astype(float32)."""
    args, _, _ = make_case(400, *CASES[4])
    q, pool, *rest = with_8bit_pool(args, q_dtype, kv_dtype, seed=1)
    for window, cap in ((None, None), (3, 4.0)):
        run = jax.jit(lambda *a: ragged_paged_attention_cpu(*a, sm_scale=0.125, sliding_window=window,
                                                            soft_cap=cap))
        want = run(q.astype(jnp.float32), pool.astype(jnp.float32), *rest).astype(q.dtype)
        np.testing.assert_array_equal(np.asarray(run(q, pool, *rest)), np.asarray(want))
        if kv_dtype == "float8_e4m3fn":  # the same pool kept as its bytes (attention.FP8_BITS, CPU serving)
            as_bytes = jax.lax.bitcast_convert_type(pool, FP8_BITS)
            np.testing.assert_array_equal(np.asarray(run(q, as_bytes, *rest)), np.asarray(want))


def test_cpu_kernel_float32_q_over_bfloat16_pool():
    """--kv-cache-dtype bfloat16 under a float32 model: the bfloat16 pool's float32 value."""
    args, _, _ = make_case(400, *CASES[4])
    q, pool, *rest = args
    pool = pool.astype(jnp.bfloat16)
    run = jax.jit(lambda *a: ragged_paged_attention_cpu(*a, sm_scale=0.125))
    np.testing.assert_array_equal(np.asarray(run(q.astype(jnp.float32), pool, *rest)),
                                  np.asarray(run(q.astype(jnp.float32), pool.astype(jnp.float32), *rest)))


# 64: the unrolled path; 256: the generic one; 8: below the x86 F16C path's 16 lanes, so the
# portable decode (what CPUs without F16C run) is checked here too.
@pytest.mark.parametrize("head_dim", [64, 256, 8])
def test_cpu_kernel_decodes_every_fp8_byte_exactly(head_dim):
    """One key: the output is its V, so V holding all 256 bytes shows each decoded value."""
    kv_heads = 256 // head_dim
    values = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    pool = np.zeros((1, 1, 2 * kv_heads, head_dim), ml_dtypes.float8_e4m3fn)
    pool[0, 0, 1::2] = values.reshape(kv_heads, head_dim)  # V of each head; K stays zero
    q = jnp.zeros((1, kv_heads, head_dim), jnp.float32)
    i32 = lambda *a: jnp.asarray(a, jnp.int32)  # noqa: E731
    out = ragged_paged_attention_cpu(q, jnp.asarray(pool), i32(1), i32([0]), i32(0, 1), i32(1), sm_scale=1.0)
    got, want = np.asarray(out).ravel(), values.astype(np.float32)
    nan = np.isnan(want)
    assert nan.sum() == 2 and np.isnan(got[nan]).all()  # 0x7F and 0xFF
    # (0x80's -0.0 comes out +0.0 here, as from a float32 pool: the weighted sum starts at +0.)
    np.testing.assert_array_equal(got[~nan], want[~nan])


@pytest.mark.parametrize("q_dtype, kv_dtype", [("bfloat16", "float32"), ("float16", "int8"), ("int8", "int8"),
                                               ("float32", "int16")])
def test_cpu_kernel_rejects_other_dtypes(q_dtype, kv_dtype):
    args, _, _ = make_case(0, *CASES[0])
    q, pool, *rest = args
    with pytest.raises(ValueError, match="CPU kernel takes"):
        ragged_paged_attention_cpu(q.astype(q_dtype), pool.astype(kv_dtype), *rest, sm_scale=0.125)


def test_cpu_kernel_many_sequences_over_threads():
    """Enough work items (sequences x row tiles x KV heads) that the thread pool shares them."""
    rng = np.random.default_rng(5)
    specs = [(1, int(n)) for n in rng.integers(1, 300, 48)] + [(int(q), int(q) + int(c)) for q, c in
                                                                 zip(rng.integers(2, 40, 8), rng.integers(0, 90, 8))]
    args, _, _ = make_case(13, 9, 3, 64, 16, specs)
    ref = ragged_paged_attention_xla(*args, sm_scale=0.125)
    for _ in range(3):  # the split of work between threads differs between calls
        assert rel(ragged_paged_attention_cpu(*args, sm_scale=0.125), ref) <= 1e-5


def test_cpu_kernel_never_reads_outside_the_pool():
    """A malformed step (page ids past the pool, a length past the page table) must not crash the
    process: the kernel skips what it cannot address."""
    args, _, _ = make_case(17, *CASES[1])
    q, pool, kv_lens, tables, cu, ns = args
    bad_tables = tables.at[0, 0].set(pool.shape[0] + 1000).at[1, 0].set(-5)
    bad_lens = kv_lens.at[2].set(tables.shape[1] * pool.shape[1] + 500)
    out = ragged_paged_attention_cpu(q, pool, bad_lens, bad_tables, cu, ns, sm_scale=0.125)
    assert bool(jnp.isfinite(out).all())


def _resolve_auto_backend(cache_dir, **env) -> subprocess.CompletedProcess:
    """resolve_backend('auto') in a fresh process with its own kernel cache."""
    env = {**os.environ, "JAXSERVE_CACHE_DIR": str(cache_dir), "JAX_PLATFORMS": "cpu", **env}
    code = "from jaxserve.attention import resolve_backend; print(resolve_backend('auto'))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_cpu_kernel_builds_from_an_empty_cache(tmp_path):
    """A fresh machine compiles the kernel on first use (what CI's cached build would hide)."""
    done = _resolve_auto_backend(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cpu"
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 1


def test_cpu_kernel_unavailable_falls_back_to_xla(tmp_path):
    """Without a compiler, 'auto' serves through the XLA path instead of failing."""
    done = _resolve_auto_backend(tmp_path, CXX="false")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "xla"
    assert "CPU attention kernel unavailable" in done.stderr


def test_options_change_the_result():
    """Guards the tests above against a window or cap that silently does nothing."""
    args, _, _ = make_case(7, *CASES[1])
    plain = ragged_paged_attention_xla(*args, sm_scale=0.125)
    assert rel(ragged_paged_attention_xla(*args, sm_scale=0.125, sliding_window=5), plain) > 1e-2
    assert rel(ragged_paged_attention_xla(*args, sm_scale=0.125, soft_cap=1.0), plain) > 1e-2


def test_bfloat16_within_stated_bound():
    args, k_new, v_new = make_case(9, *CASES[1], dtype=jnp.bfloat16)
    ref = dense_reference(args, 0.125)
    assert rel(ragged_paged_attention_xla(*args, sm_scale=0.125), ref) <= 2e-2
    assert rel(ragged_paged_attention_split(*args, k_new=k_new, v_new=v_new, sm_scale=0.125), ref) <= 2e-2
    assert rel(ragged_paged_attention_gpu(*args, sm_scale=0.125, interpret=True), ref) <= 2e-2
    ours = ragged_paged_attention_cpu(*args, sm_scale=0.125)
    assert ours.dtype == jnp.bfloat16 and rel(ours, ref) <= 2e-2


def test_garbage_in_unused_pages_does_not_leak():
    args, k_new, v_new = make_case(11, *CASES[0])
    q, pool, kv_lens, tables, cu, ns = args
    used = set(np.asarray(tables).ravel().tolist())
    unused = [p for p in range(pool.shape[0]) if p not in used or p == 0]
    poisoned = pool.at[jnp.asarray(unused)].set(1e6)
    for fn in (ragged_paged_attention_xla,
               lambda *a, **k: ragged_paged_attention_split(*a, k_new=k_new, v_new=v_new, **k),
               lambda *a, **k: ragged_paged_attention_gpu(*a, interpret=True, **k),
               ragged_paged_attention_cpu):
        a = fn(q, pool, kv_lens, tables, cu, ns, sm_scale=0.125)
        b = fn(q, poisoned, kv_lens, tables, cu, ns, sm_scale=0.125)
        assert rel(b, a) <= 1e-6
