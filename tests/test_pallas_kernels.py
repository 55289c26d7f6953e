"""Pallas ragged paged attention kernels (interpret mode on CPU) vs the XLA reference, and the
reference vs dense float64 numpy attention.

Bounds: f32 relative error (max |out - ref| / max |ref|) <= 1e-5. bf16 pools/queries: <= 3e-2, since
the kernels feed bf16 softmax probabilities (and the GPU kernels bf16 q*scale) to the MXU/tensor-core
dots (f32 accumulate) while the reference upcasts everything to f32; measured ~3e-3 to 5e-3.
8-bit pools (int8, float8_e4m3fn; scales are the caller's) must give the f32 pool's result: the
reference upcasts, the kernels upcast after the load, so f32 q keeps 1e-5 and bf16 q the output
rounding (1e-2); measured <= 3.4e-6 and <= 1.4e-4.
Interpret mode is slow, so the cases are few and each covers many features at once; four seeded
random batches add GQA ratios that are not powers of two and other mixes.
The hardware-only code paths (the TPU kernel's strided K/V loads, Triton codegen) cannot run here;
they are at least lowered for their platforms (Pallas -> Mosaic / Triton IR) in
test_kernels_lower_for_their_hardware, and the TPU kernel is compiled by the real Mosaic compiler
in tests/test_tpu_compile.py. The TPU kernel's interpret-mode runs use kv_split="emulated": the
strided path's index arithmetic on loaded values (the interpreter has no strided loads).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention import ragged_paged_attention_xla
from jaxserve.pallas_kernels import ragged_paged_attention_pallas
from jaxserve.pallas_kernels.ragged_paged_attention_gpu import aot_target, ragged_paged_attention_gpu
from jaxserve.pallas_kernels.ragged_paged_attention_tpu import ragged_paged_attention_tpu

F32_TOL = 1e-5
BF16_TOL = 3e-2


@dataclass
class Case:
    name: str
    q_lens: list[int]
    kv_lens: list[int]
    page_size: int
    kv_heads: int
    group: int
    head_dim: int
    pad_seqs: int = 2        # extra sequence rows past num_seqs
    pad_tokens: int = 5      # extra query rows past the last sequence
    sliding_window: int | None = None
    soft_cap: float | None = None
    dtype: str = "float32"
    garbage_ids: bool = False  # page-table entries past a sequence's end hold random page ids
    kv_dtype: str | None = None  # the pool's dtype when it differs from q's (8-bit pools)


CASES = [
    # decodes and prefill chunks with kv lengths 0 / 1 / page-1 / page / page+1 / long; GQA 4
    Case("mixed_ps8_d64_g4", [1, 1, 5, 0, 1, 12, 1], [1, 7, 8, 0, 9, 40, 70], 8, 2, 4, 64),
    # MQA (group 8), head_dim 128, sliding window + soft cap, prefill with prior context
    Case("mqa_ps16_d128_swa_cap", [1, 20, 1, 3], [33, 45, 16, 17], 16, 1, 8, 128,
         sliding_window=10, soft_cap=5.0, garbage_ids=True),
    # MHA (group 1), big pages, a prefill spanning several q blocks
    Case("mha_ps32_d64", [37, 1, 1], [100, 31, 33], 32, 4, 1, 64, pad_tokens=3),
    # group 2, page 64, chunk longer than one KV block, window wider than one page
    Case("g2_ps64_d128_swa", [1, 24, 1], [65, 90, 64], 64, 2, 2, 128, sliding_window=70, pad_seqs=1),
]
BF16_CASE = Case("bf16_ps16_d128_g2_cap", [1, 9, 1], [17, 40, 120], 16, 2, 2, 128, soft_cap=20.0, dtype="bfloat16")


def make_inputs(case: Case, seed: int = 0, garbage_seed: int = 1, nan_garbage: bool = False):
    """Pool with real data in shuffled pages (never page 0), random garbage everywhere else."""
    rng = np.random.default_rng(seed)
    ps, kvh, g, d = case.page_size, case.kv_heads, case.group, case.head_dim
    n_real = len(case.q_lens)
    num_seqs_max = n_real + case.pad_seqs
    pages_needed = [-(-L // ps) for L in case.kv_lens]
    max_pages = max(pages_needed) + 1  # a spare column past every sequence's end
    num_pages = sum(pages_needed) + 4
    perm = rng.permutation(np.arange(1, num_pages))
    page_tables = np.zeros((num_seqs_max, max_pages), np.int32)
    k = 0
    for s, n in enumerate(pages_needed):
        page_tables[s, :n] = perm[k:k + n]
        k += n
        if case.garbage_ids:
            page_tables[s, n:] = rng.integers(0, num_pages, max_pages - n)
    kv_lens = np.zeros(num_seqs_max, np.int32)
    kv_lens[:n_real] = case.kv_lens
    cu = np.zeros(num_seqs_max + 1, np.int32)
    cu[1:n_real + 1] = np.cumsum(case.q_lens)
    cu[n_real + 1:] = cu[n_real]
    t = int(cu[-1]) + case.pad_tokens
    dtype = jnp.dtype(case.dtype)
    kv_dtype = jnp.dtype(case.kv_dtype or case.dtype)
    q = rng.standard_normal((t, kvh * g, d)).astype(np.float32)
    real = rng.standard_normal((num_pages, ps, 2 * kvh, d)).astype(np.float32)
    # Garbage (large, finite) in every slot no sequence owns: unused pages and page tails.
    garbage = np.random.default_rng(garbage_seed).uniform(-300, 300, real.shape).astype(np.float32)
    if kv_dtype.itemsize == 1:  # stored values span the 8-bit range; q carries the K scale, as the caller's
        real, q = _real_8bit(real, kv_dtype.name), q / (64.0 if kv_dtype == jnp.int8 else 8.0)
        garbage = np.clip(garbage, -128, 127)
    if nan_garbage:
        garbage[..., ::2] = np.nan  # NaN and inf: 0 * garbage must never reach a sum
        garbage[..., 1::2] = np.inf
    owned = np.zeros((num_pages, ps), bool)
    for s in range(n_real):
        for i in range(case.kv_lens[s]):
            owned[page_tables[s, i // ps], i % ps] = True
    pool = np.where(owned[:, :, None, None], real, garbage)
    args = (jnp.asarray(q, dtype), jnp.asarray(pool, kv_dtype), jnp.asarray(kv_lens), jnp.asarray(page_tables),
            jnp.asarray(cu), jnp.asarray([n_real], jnp.int32))
    kw = dict(sm_scale=d ** -0.5, sliding_window=case.sliding_window, soft_cap=case.soft_cap)
    return args, kw


def _real_8bit(x: np.ndarray, dtype: str) -> np.ndarray:
    """Values an 8-bit pool holds (already rounded and clipped by the KV write): int8 integers in
    [-127, 127]; float8_e4m3fn up to +-448 with subnormals (|x| < 2^-6) and both zeros."""
    if dtype == "int8":
        return np.clip(np.round(x * 45.0), -127, 127)
    x = x * 8.0
    x.flat[::7] *= 2.0 ** -12  # subnormals and values that round to +-0
    x.flat[3::11] = np.sign(x.flat[3::11]) * 448.0  # the largest finite value
    return np.asarray(jnp.asarray(x, jnp.float8_e4m3fn), np.float32)


def dense_attention_f64(args, kw) -> np.ndarray:
    """Per-sequence dense causal attention in float64 from the gathered pages."""
    q, pool, kv_lens, page_tables, cu, num_seqs = (np.asarray(a, np.float64) if i < 2 else np.asarray(a)
                                                   for i, a in enumerate(args))
    t, h, d = q.shape
    _, ps, two_kvh, _ = pool.shape
    kvh = two_kvh // 2
    g = h // kvh
    out = np.zeros_like(q)
    for s in range(int(num_seqs[0])):
        q_len, kv_len = cu[s + 1] - cu[s], kv_lens[s]
        if q_len == 0:
            continue
        slots = [(page_tables[s, i // ps], i % ps) for i in range(kv_len)]
        kv = np.stack([pool[p, o] for p, o in slots]) if slots else np.zeros((0, two_kvh, d))
        k, v = kv[:, 0::2], kv[:, 1::2]  # [L, KVH, D]
        qs = q[cu[s]:cu[s + 1]].reshape(q_len, kvh, g, d) * kw["sm_scale"]
        sc = np.einsum("qkgd,lkd->qkgl", qs, k)
        if kw["soft_cap"] is not None:
            sc = kw["soft_cap"] * np.tanh(sc / kw["soft_cap"])
        q_pos = kv_len - q_len + np.arange(q_len)
        j = np.arange(kv_len)
        mask = j[None, :] <= q_pos[:, None]
        if kw["sliding_window"] is not None:
            mask &= j[None, :] > q_pos[:, None] - kw["sliding_window"]
        sc = np.where(mask[:, None, None, :], sc, -np.inf)
        mx = sc.max(-1, keepdims=True)
        p = np.exp(sc - np.where(np.isfinite(mx), mx, 0.0))
        l = p.sum(-1, keepdims=True)
        o = np.einsum("qkgl,lkd->qkgd", p, v) / np.where(l > 0, l, 1.0)
        out[cu[s]:cu[s + 1]] = o.reshape(q_len, h, d)
    return out


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


def real_rows(args) -> int:
    cu, num_seqs = np.asarray(args[4]), int(np.asarray(args[5])[0])
    return int(cu[num_seqs])


def tpu_interp(*a, **kw):
    return ragged_paged_attention_tpu(*a, **kw, interpret=True, block_q=8, pages_per_block=2)


def gpu_interp(*a, **kw):
    return ragged_paged_attention_gpu(*a, **kw, interpret=True, block_q=16, block_kv=16, split_tokens=32)


def tpu_cross_step_interp(*a, **kw):
    """With the next grid step's first KV block started during this step's last (v5e / v6e)."""
    return ragged_paged_attention_tpu(*a, **kw, interpret=True, block_q=8, pages_per_block=2,
                                      cross_step_prefetch=True)


KERNELS = {"tpu": tpu_interp, "tpu_cross_step": tpu_cross_step_interp, "gpu": gpu_interp}


@pytest.mark.parametrize("case", CASES + [BF16_CASE], ids=lambda c: c.name)
def test_reference_vs_dense_f64(case: Case):
    args, kw = make_inputs(case)
    ref = ragged_paged_attention_xla(*args, **kw)
    err = rel_err(ref, dense_attention_f64(args, kw))
    assert err <= (F32_TOL if case.dtype == "float32" else 1e-2), err  # bf16: output rounding only
    assert not np.asarray(ref[real_rows(args):], np.float32).any()


@pytest.mark.parametrize("kernel", list(KERNELS), ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kernel_vs_reference_f32(kernel: str, case: Case):
    args, kw = make_inputs(case)
    out = np.asarray(KERNELS[kernel](*args, **kw))
    ref = np.asarray(ragged_paged_attention_xla(*args, **kw))
    err = rel_err(out, ref)
    print(f"{kernel} {case.name}: rel err {err:.2e}")
    assert err <= F32_TOL, err
    assert not out[real_rows(args):].any(), "padding rows must be zero"


@pytest.mark.parametrize("kernel", list(KERNELS), ids=str)
def test_kernel_vs_reference_bf16(kernel: str):
    args, kw = make_inputs(BF16_CASE)
    out = KERNELS[kernel](*args, **kw)
    assert out.dtype == jnp.bfloat16
    err = rel_err(out, ragged_paged_attention_xla(*args, **kw))
    print(f"{kernel} bf16: rel err {err:.2e}")
    assert err <= BF16_TOL, err
    assert not np.asarray(out[real_rows(args):], np.float32).any()


# 8-bit pools: the kernels must give what they give for the pool upcast to f32 (scales are the
# caller's). GPU kernels: decode + prefill mix with GQA 4 (d64), and MQA d128 with window, soft cap
# and garbage page ids, q in f32 and bf16. The TPU kernel's 8-bit unpacking is exercised per slab
# layout in test_tpu_kernel_8bit_pool_interpret (its interpreter is slow).
KV_8BIT = ["int8", "float8_e4m3fn"]


@pytest.mark.parametrize("q_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv_dtype", KV_8BIT)
@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: c.name)
def test_gpu_kernel_8bit_pool(case: Case, kv_dtype: str, q_dtype: str):
    args, kw = make_inputs(dataclasses.replace(case, dtype=q_dtype, kv_dtype=kv_dtype))
    assert args[1].dtype == jnp.dtype(kv_dtype)
    out = gpu_interp(*args, **kw)
    assert out.dtype == jnp.dtype(q_dtype)
    ref = ragged_paged_attention_xla(*args, **kw)
    f32_pool = ragged_paged_attention_xla(args[0], args[1].astype(jnp.float32), *args[2:], **kw)
    np.testing.assert_array_equal(np.asarray(ref, np.float32), np.asarray(f32_pool, np.float32))
    err = rel_err(out, ref)
    print(f"gpu {case.name} {kv_dtype} q {q_dtype}: rel err {err:.2e}")
    assert err <= (F32_TOL if q_dtype == "float32" else 1e-2), err  # bf16 q: output rounding only
    assert not np.asarray(out[real_rows(args):], np.float32).any()


@pytest.mark.parametrize("kernel", list(KERNELS), ids=str)
def test_garbage_in_unused_slots_is_ignored(kernel: str):
    case = CASES[1]  # garbage page ids past the end too
    a1, kw = make_inputs(case, garbage_seed=1)
    a2, _ = make_inputs(case, garbage_seed=2)
    assert not np.array_equal(np.asarray(a1[1]), np.asarray(a2[1]))
    np.testing.assert_array_equal(np.asarray(KERNELS[kernel](*a1, **kw)), np.asarray(KERNELS[kernel](*a2, **kw)))


@pytest.mark.parametrize("kernel", list(KERNELS), ids=str)
def test_nonfinite_garbage_in_unused_slots_is_ignored(kernel: str):
    """NaN/inf in page tails, unused pages and the null page: same output as finite garbage."""
    case = CASES[0]
    a1, kw = make_inputs(case)
    a2, _ = make_inputs(case, nan_garbage=True)
    assert np.isnan(np.asarray(a2[1])).any()
    out = np.asarray(KERNELS[kernel](*a2, **kw))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out, np.asarray(KERNELS[kernel](*a1, **kw)))


def random_case(seed: int) -> Case:
    """A random small batch: decodes, prefill chunks with and without prior context, empty rows,
    any GQA ratio 1..8, page size 8..64, optional window / soft cap / garbage page ids."""
    rng = np.random.default_rng(1000 + seed)
    page_size = int(rng.choice([8, 16, 32, 64]))
    n = int(rng.integers(2, 7))
    q_lens = [int(rng.choice([0, 1, 1, 1, 2, 7, 17])) for _ in range(n)]
    priors = [int(rng.choice([0, 1, page_size - 1, page_size, page_size + 1, 3 * page_size + 5])) for _ in range(n)]
    kv_lens = [q + p if q else int(rng.choice([0, p])) for q, p in zip(q_lens, priors)]
    if not any(q_lens):
        q_lens[0], kv_lens[0] = 1, 1
    return Case(f"random{seed}", q_lens, kv_lens, page_size, kv_heads=int(rng.choice([1, 2, 4])),
                group=int(rng.integers(1, 9)), head_dim=int(rng.choice([64, 128])),
                pad_seqs=int(rng.integers(0, 3)), pad_tokens=int(rng.integers(0, 10)),
                sliding_window=[None, None, 1, 9, 40][int(rng.integers(5))],
                soft_cap=[None, 10.0][int(rng.integers(2))], garbage_ids=bool(rng.integers(2)))


@pytest.mark.parametrize("seed", range(4))
def test_random_shapes_kernels_vs_reference(seed: int):
    case = random_case(seed)
    args, kw = make_inputs(case, seed=seed)
    ref = np.asarray(ragged_paged_attention_xla(*args, **kw))
    assert rel_err(ref, dense_attention_f64(args, kw)) <= F32_TOL
    for name, fn in KERNELS.items():
        out = np.asarray(fn(*args, **kw))
        err = rel_err(out, ref)
        print(f"{name} {case}: rel err {err:.2e}")
        assert err <= F32_TOL, (name, case, err)
        assert not out[real_rows(args):].any(), name


def _lower_for(fn, platform: str, args, kw) -> str:
    return jax.jit(functools.partial(fn, **kw)).trace(*args).lower(lowering_platforms=(platform,)).as_text()


LOWER_SHAPES = [  # (kv_heads, group, head_dim, page_size, dtype): Llama-8B-like bf16, MQA f32 d64
    (8, 4, 128, 16, jnp.bfloat16),
    (1, 8, 64, 32, jnp.float32),
]


@pytest.mark.parametrize("shape", LOWER_SHAPES, ids=lambda s: f"kvh{s[0]}_g{s[1]}_d{s[2]}_{jnp.dtype(s[4]).name}")
def test_kernels_lower_for_their_hardware(shape, monkeypatch):
    """Pallas lowering (no device needed) of the real TPU path (strided K/V loads, bf16 word
    split) and of the Triton kernels, on a big flat pool. Catches unsupported primitives and
    shapes; Mosaic's and Triton's own compilers still only run on the devices."""
    kvh, g, d, ps, dtype = shape
    sds = jax.ShapeDtypeStruct
    seqs, width, tokens = 32, 64, 64
    args = (sds((tokens, kvh * g, d), dtype), sds((30 * 2000, ps, 2 * kvh, d), dtype), sds((seqs,), jnp.int32),
            sds((seqs, width), jnp.int32), sds((seqs + 1,), jnp.int32), sds((1,), jnp.int32))
    kw = dict(sm_scale=d ** -0.5, sliding_window=128, soft_cap=30.0)
    with aot_target():  # jax >= 0.11 lowers for CUDA only against an (abstract) GPU device
        assert "jaxserve_rpa_decode" in _lower_for(ragged_paged_attention_gpu, "cuda", args, kw)
    try:  # Mosaic lowering asks the default device for its TPU generation: pretend a v5e.
        from jax._src.pallas.mosaic import tpu_info
        monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5 lite")
        monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
    except (ImportError, AttributeError):
        pytest.skip("this jax has no tpu_info hook to lower for TPU off-device")
    # jax >= 0.11 reads the TPU generation from an abstract mesh's device instead (jax._src.tpu_info).
    dev = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("aot",), abstract_device=dev)):
        text = _lower_for(functools.partial(ragged_paged_attention_tpu, kv_split="strided"), "tpu", args, kw)
    assert "tpu_custom_call" in text


# --- GPU kernel: the per-device tiles (GPU_BLOCKS), interpreted --------------------------------
@pytest.mark.parametrize("case", [BF16_CASE, CASES[1]], ids=lambda c: c.name)
def test_gpu_hopper_tile_interpret(case: Case):
    """The Hopper table's tiles (bf16: block_q 64 for wgmma, block_kv 128; f32: block_q 32), interpreted."""
    from jaxserve.pallas_kernels.ragged_paged_attention_gpu import gpu_blocks_for

    b = gpu_blocks_for("NVIDIA H200")
    args, kw = make_inputs(case)
    bq = b.block_q_16bit if case.dtype == "bfloat16" else b.block_q_f32
    out = ragged_paged_attention_gpu(*args, **kw, interpret=True, block_q=bq, block_kv=b.block_kv, split_tokens=64)
    err = rel_err(out, ragged_paged_attention_xla(*args, **kw))
    assert err <= (F32_TOL if case.dtype == "float32" else BF16_TOL), err
    assert not np.asarray(out[real_rows(args):], np.float32).any()


def test_gpu_block_sizes_fit_shared_memory():
    """Defaults shrink to the device's shared memory; explicit sizes that cannot fit are an error
    naming the setting, raised while tracing (before any compiler runs)."""
    from jaxserve.pallas_kernels.ragged_paged_attention_gpu import _fit_blocks, gpu_blocks_for

    h200, l4 = gpu_blocks_for("NVIDIA H200"), gpu_blocks_for("NVIDIA L4")
    fit = functools.partial(_fit_blocks, rows_decode=16, num_warps=4, kind="test", dtype_name="x", kv_from="block_kv")
    assert fit(block_q=None, block_kv=None, head_dim=128, itemsize=2, blocks=h200) == (64, 128)
    assert fit(block_q=None, block_kv=None, head_dim=128, itemsize=4, blocks=h200) == (32, 128)  # ~224 KB
    assert fit(block_q=None, block_kv=None, head_dim=256, itemsize=4, blocks=h200) == (32, 32)  # clamped
    assert fit(block_q=None, block_kv=None, head_dim=256, itemsize=4, blocks=l4) == (32, 16)  # 99 KB
    with pytest.raises(ValueError, match="block_kv.*227 KB"):
        fit(block_q=None, block_kv=512, head_dim=128, itemsize=2, blocks=h200)  # decode alone ~405 KB
    args, kw = make_inputs(CASES[1])
    with aot_target("NVIDIA H100 80GB HBM3"), pytest.raises(ValueError, match=r"pages_per_block=64 x page_size=16"):
        jax.jit(functools.partial(ragged_paged_attention_gpu, **kw, pages_per_block=64)).trace(*args).lower(
            lowering_platforms=("cuda",))


def test_dispatcher_under_jit_and_layer_scan():
    """The engine's use: jit, lax.scan over layers, flat all-layer pool, page tables offset by layer."""
    assert jax.default_backend() == "cpu"
    case = CASES[0]
    args, kw = make_inputs(case)
    q, pool, kv_lens, pt, cu, ns = args
    layers = 2
    n = pool.shape[0]
    flat = jnp.concatenate([pool, pool[..., ::-1]], axis=0)  # layer 1: same pages, other data

    def run(fn):
        @jax.jit
        def go(q, flat, kv_lens, pt, cu, ns):
            def layer(c, l):
                return c, fn(q, flat, kv_lens, pt + l * n, cu, ns, **kw)
            return jax.lax.scan(layer, 0, jnp.arange(layers))[1]
        return go(q, flat, kv_lens, pt, cu, ns)

    out = run(ragged_paged_attention_pallas)
    ref = run(ragged_paged_attention_xla)
    assert rel_err(out, ref) <= F32_TOL
    assert rel_err(out[0], out[1]) > 1e-2  # the layers really read different pages


# --- TPU kernel: every K/V layout path of the page slabs, in interpret mode ------------------
# The TPU interpreter cannot run Mosaic's sublane-strided loads or ref bitcasts, so these run the
# kernel with kv_split="emulated": the same start/stride/word-half choices computed on loaded
# values. The strided loads themselves are only compiled (tests/test_tpu_compile.py), not run.
TPU_LAYOUT_CASES = [
    # SmolLM2-like: 3 KV heads x group 3, head_dim 64, bf16: odd heads -> words straddle tokens
    # (even/odd column order); block_q 16 -> 48 rows, decodes take the 32-row narrow window
    (Case("smol_bf16_d64_kvh3", [1, 1, 7, 1], [20, 33, 40, 1], 16, 3, 3, 64, dtype="bfloat16",
          garbage_ids=True), 16),
    # head_dim 64, even KV heads, bf16: a [K|V] row is one half of a word
    (Case("bf16_d64_kvh2_g4_swa", [1, 12, 1], [50, 30, 17], 16, 2, 4, 64, dtype="bfloat16",
          sliding_window=20), 16),
    # head_dim 64, odd heads, f32: stride-3 row loads
    (Case("f32_d64_kvh3_cap", [2, 1, 9], [18, 40, 9], 16, 3, 2, 64, soft_cap=30.0), 8),
    # head_dim 256 (Gemma-like), f32 and bf16: two 128-lane rows per K and per V
    (Case("f32_d256_g2", [1, 6, 1], [35, 20, 64], 16, 2, 2, 256, sliding_window=24), 8),
    (Case("bf16_d256_g2_cap", [1, 6, 1], [35, 20, 64], 16, 2, 2, 256, dtype="bfloat16", soft_cap=50.0), 16),
    # many decodes in one q block (narrow windows at every offset) plus a chunk that needs the full block
    (Case("f32_decodes_g4", [1] * 10 + [5], [3, 17, 16, 40, 1, 9, 33, 64, 2, 20, 30], 16, 2, 4, 64), 16),
]


@pytest.mark.parametrize("case,block_q", TPU_LAYOUT_CASES, ids=lambda c: getattr(c, "name", str(c)))
def test_tpu_kernel_slab_layouts_interpret(case: Case, block_q: int):
    args, kw = make_inputs(case)
    out = ragged_paged_attention_tpu(*args, **kw, interpret=True, block_q=block_q, pages_per_block=2)
    ref = ragged_paged_attention_xla(*args, **kw)
    err = rel_err(out, ref)
    print(f"tpu {case.name}: rel err {err:.2e}")
    assert err <= (F32_TOL if case.dtype == "float32" else BF16_TOL), err
    assert not np.asarray(out[real_rows(args):], np.float32).any(), "padding rows must be zero"


# 8-bit pools on the TPU kernel: 4 rows per 32-bit word, so words straddle tokens in periods of
# 1, 2 or 4 tokens depending on the rows per token (W); one case per period and K/V row layout.
TPU_8BIT_CASES = [
    # SmolLM2-like d64, 3 KV heads: W=3 -> period 4; bf16 q (narrow windows of 16 rows)
    (Case("smol_int8_d64_kvh3", [1, 1, 7, 1], [20, 33, 40, 1], 16, 3, 3, 64, dtype="bfloat16",
          kv_dtype="int8", garbage_ids=True), 16),
    # d64, 2 KV heads: W=2 -> period 2; decode + prefill mix, GQA 4, page 8
    (dataclasses.replace(CASES[0], name="mixed_fp8_d64_g4", kv_dtype="float8_e4m3fn"), 8),
    # MQA d128: W=2 (K row, V row) -> period 2; window, soft cap, garbage page ids
    (dataclasses.replace(CASES[1], name="mqa_fp8_d128_swa_cap", kv_dtype="float8_e4m3fn"), 8),
    # d256, 2 KV heads: W=8 -> period 1, two rows per K and per V
    (Case("int8_d256_g2_cap", [1, 6, 1], [35, 20, 64], 16, 2, 2, 256, soft_cap=50.0, kv_dtype="int8"), 8),
]


@pytest.mark.parametrize("case,block_q", TPU_8BIT_CASES, ids=lambda c: getattr(c, "name", str(c)))
def test_tpu_kernel_8bit_pool_interpret(case: Case, block_q: int):
    args, kw = make_inputs(case)
    out = ragged_paged_attention_tpu(*args, **kw, interpret=True, block_q=block_q, pages_per_block=2)
    assert out.dtype == jnp.dtype(case.dtype)
    err = rel_err(out, ragged_paged_attention_xla(*args, **kw))
    print(f"tpu {case.name}: rel err {err:.2e}")
    assert err <= (F32_TOL if case.dtype == "float32" else 1e-2), err  # bf16 q: output rounding only
    assert not np.asarray(out[real_rows(args):], np.float32).any(), "padding rows must be zero"


@pytest.mark.parametrize("kv_dtype", KV_8BIT)
def test_8bit_lane_dense_row_write_and_read(kv_dtype: str):
    """write_kv_rows on a lane-dense 8-bit pool: the same bytes as write_kv on the 4-D pool, values
    (already in the storage range) stored exactly; the dispatcher reads that pool as the 4-D one."""
    from jaxserve.attention import write_kv
    from jaxserve.pallas_kernels.ragged_paged_attention_tpu import pool_as_slabs, write_kv_rows

    case = dataclasses.replace(TPU_8BIT_CASES[0][0], kv_dtype=kv_dtype)
    args, kw = make_inputs(case)
    pool = args[1]
    rng = np.random.default_rng(3)
    t, kvh, d = 6, case.kv_heads, case.head_dim
    k, v = (jnp.asarray(_real_8bit(rng.standard_normal((t, kvh, d)).astype(np.float32), kv_dtype), jnp.bfloat16)
            for _ in range(2))
    slots = jnp.asarray([0, 17, 18, 31, 5 * 16 + 3, 2], jnp.int32)
    want = write_kv(pool, k, v, slots)
    got = write_kv_rows(pool_as_slabs(pool), k, v, slots, case.page_size)
    assert got.dtype == jnp.dtype(kv_dtype)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(pool_as_slabs(want)).view(np.uint8))
    flat = np.asarray(want.reshape(-1, 2 * kvh, d), np.float32)[np.asarray(slots)]
    np.testing.assert_array_equal(flat[:, 0::2], np.asarray(k, np.float32))  # exact: in range, representable
    np.testing.assert_array_equal(flat[:, 1::2], np.asarray(v, np.float32))
    a4 = ragged_paged_attention_pallas(args[0], want, *args[2:], **kw)
    a3 = ragged_paged_attention_pallas(args[0], got, *args[2:], **kw, pool_page_size=case.page_size)
    np.testing.assert_array_equal(np.asarray(a3, np.float32), np.asarray(a4, np.float32))


def test_tpu_lane_dense_pool_and_row_write():
    """The lane-dense pool [N, page*W, 128] (no relayout copies for head_dim 64 on TPU): the row
    write gives the same bytes as write_kv on the 4-D pool, and the kernel reads it the same."""
    from jaxserve.attention import write_kv
    from jaxserve.pallas_kernels.ragged_paged_attention_tpu import pool_as_slabs, write_kv_rows

    case = TPU_LAYOUT_CASES[0][0]
    args, kw = make_inputs(case)
    pool = args[1]
    rng = np.random.default_rng(3)
    t, kvh, d = 6, case.kv_heads, case.head_dim
    k = jnp.asarray(rng.standard_normal((t, kvh, d)), pool.dtype)
    v = jnp.asarray(rng.standard_normal((t, kvh, d)), pool.dtype)
    slots = jnp.asarray([0, 17, 18, 31, 5 * 16 + 3, 2], jnp.int32)
    want = pool_as_slabs(write_kv(pool, k, v, slots))
    got = write_kv_rows(pool_as_slabs(pool), k, v, slots, case.page_size)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    a4 = ragged_paged_attention_tpu(*args, **kw, interpret=True, block_q=16, pages_per_block=2)
    slab_args = (args[0], pool_as_slabs(pool), *args[2:])
    a3 = ragged_paged_attention_tpu(*slab_args, **kw, interpret=True, block_q=16, pages_per_block=2,
                                    pool_page_size=case.page_size)
    np.testing.assert_array_equal(np.asarray(a3, np.float32), np.asarray(a4, np.float32))


def test_tpu_limits_fail_early_with_the_setting_to_change(monkeypatch):
    """Shapes Mosaic would reject deep in warm-up are refused by the planner, naming the setting."""
    from jaxserve.pallas_kernels.ragged_paged_attention_tpu import check_tpu_limits, plan_tpu_launch

    try:  # plan for a v5e (128 MiB VMEM, 1 MiB SMEM), as a deviceless compile would
        from jax._src.pallas.mosaic import tpu_info
        monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5 lite")
        monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
    except (ImportError, AttributeError):
        pytest.skip("this jax has no tpu_info hook to plan for a TPU off-device")

    with pytest.raises(ValueError, match="max_num_seqs"):  # 512 seqs x 8K ctx / page 16 = 2^18 entries
        check_tpu_limits(num_heads=32, kv_heads=8, head_dim=128, page_size=16, max_num_seqs=512,
                         max_model_len=8192, max_num_batched_tokens=512, dtype=jnp.bfloat16)
    plan = check_tpu_limits(num_heads=32, kv_heads=8, head_dim=128, page_size=32, max_num_seqs=512,
                            max_model_len=8192, max_num_batched_tokens=512, dtype=jnp.bfloat16)
    assert plan.smem_bytes < 1024 * 1024
    with pytest.raises(ValueError, match="head_dim"):
        plan_tpu_launch(num_tokens=64, num_heads=8, kv_heads=2, head_dim=80, page_size=16, max_seqs=8,
                        pages_per_seq=8, q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="page_size"):  # 8 tokens x 1 row: half a bf16 tile
        plan_tpu_launch(num_tokens=64, num_heads=8, kv_heads=1, head_dim=64, page_size=8, max_seqs=8,
                        pages_per_seq=8, q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16)
    # block_q 256 of Llama-3-8B: the estimate raises the scoped VMEM limit past the 16/32 MiB default
    big = plan_tpu_launch(num_tokens=512, num_heads=32, kv_heads=8, head_dim=128, page_size=16, max_seqs=64,
                          pages_per_seq=128, q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, block_q=256)
    assert big.vmem_limit_bytes > 32 * 1024 * 1024 >= big.vmem_bytes // 2


@pytest.mark.parametrize("kv_heads, head_dim", [(3, 64), (2, 64), (8, 128), (1, 128), (4, 256)])
@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn])
def test_min_page_size_is_what_the_tpu_plan_accepts(kv_heads, head_dim, kv_dtype):
    """The engine raises page_size to min_page_size on TPU: the plan must accept it and refuse
    half of it (when above 1). SmolLM2 (3 KV heads of 64) with 8-bit KV: 32 tokens a page."""
    from jaxserve.pallas_kernels.ragged_paged_attention_tpu import min_page_size, plan_tpu_launch

    need = min_page_size(kv_heads, head_dim, kv_dtype)
    plan = functools.partial(plan_tpu_launch, num_tokens=64, num_heads=2 * kv_heads, kv_heads=kv_heads,
                             head_dim=head_dim, max_seqs=8, pages_per_seq=8, q_dtype=jnp.bfloat16, kv_dtype=kv_dtype)
    plan(page_size=need)
    if need > 1:
        with pytest.raises(ValueError, match="page_size"):
            plan(page_size=need // 2)
    if (kv_heads, head_dim) == (3, 64):
        assert need == (32 if jnp.dtype(kv_dtype).itemsize == 1 else 16 if jnp.dtype(kv_dtype).itemsize == 2 else 8)
