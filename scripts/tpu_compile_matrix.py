"""Compile the TPU attention kernel with the real Mosaic compiler, no TPU attached.

Each case is lowered and *compiled* (``jax.jit(...).lower(...).compile()``) against a deviceless
TPU topology from libtpu (``jax.experimental.topologies``); lowering alone accepts shapes that
Mosaic's layout rules reject. A case passes when it compiles, or when it is one of the shapes
the kernel must refuse up front (``expect_error``) and the ValueError names the limit.

  python scripts/tpu_compile_matrix.py                  # full matrix, 2 worker processes
  python scripts/tpu_compile_matrix.py --write-docs     # and refresh the table in docs/kernels.md
  python scripts/tpu_compile_matrix.py --chips v5e --json out.json

Needs ``libtpu`` beside the venv (``bash scripts/install_libtpu.sh``). tests/test_tpu_compile.py runs the same matrix.
"""

from __future__ import annotations

import argparse
import importlib
import dataclasses
import json
import math
import multiprocessing
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "kernels.md"
BEGIN, END = "<!-- tpu-compile-matrix:begin -->", "<!-- tpu-compile-matrix:end -->"

# Topology names libtpu knows; one chip of each is compiled for.
CHIPS = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    tokens: int  # T: the token bucket
    seqs: int  # S = min(T, max_num_seqs)
    pages: int  # P: pages per sequence (max_model_len / page_size)
    sliding_window: int | None = None
    soft_cap: float | None = None
    block_q: int | None = None
    layers: int = 0  # > 0: a model-like step (scan over layers, KV write + attention), pool copies counted
    slab_pool: bool = False  # the pool stored lane-dense [N, rows, 128] (head_dim 64 without copies)
    # The engine's own step (LlamaForCausalLM with the runner's layout choice and functions, small
    # hidden size, these attention shapes) instead of the model-like stand-in.
    engine_step: bool = False
    expect_error: str | None = None  # the kernel must refuse this shape up front with this text
    kv_dtype: str | None = None  # the pool's dtype when it differs from q's (8-bit pools)

    @property
    def pool_dtype(self) -> str:
        return self.kv_dtype or self.dtype

    def describe(self) -> str:
        extra = [f"kv {self.kv_dtype}"] if self.kv_dtype else []
        extra += [f"sw{self.sliding_window}"] if self.sliding_window else []
        extra += [f"cap{self.soft_cap:g}"] if self.soft_cap else []
        extra += [f"bq{self.block_q}"] if self.block_q else []
        kind = "engine step" if self.engine_step else "step"
        extra += [f"{self.layers}-layer {kind}" + (", slab pool" if self.slab_pool else "")] if self.layers else []
        return (f"{self.heads}/{self.kv_heads}/{self.head_dim} ps{self.page_size} T{self.tokens} "
                f"S{self.seqs} P{self.pages}" + (" " + " ".join(extra) if extra else ""))


def _cases() -> list[Case]:
    # Engine defaults: max_num_batched_tokens 512, max_num_seqs 64, max_model_len 2048, page 16:
    # largest bucket T=512, S=64, P=128; the largest pure-decode bucket T=64, S=64.
    c = []
    for dt in ("bfloat16", "float32"):
        c.append(Case("smollm2", 9, 3, 64, 16, dt, 512, 64, 128))
        c.append(Case("llama3-8b", 32, 8, 128, 16, dt, 512, 64, 512))
        c.append(Case("gemma2-2b", 8, 4, 256, 16, dt, 512, 64, 512, sliding_window=4096, soft_cap=50.0))
    c += [
        Case("smollm2 decode", 9, 3, 64, 16, "bfloat16", 64, 64, 128),
        Case("llama3-8b", 32, 8, 128, 32, "bfloat16", 512, 64, 256),
        Case("llama3-8b", 32, 8, 128, 64, "bfloat16", 512, 64, 128),
        Case("llama3-8b decode 256x8K", 32, 8, 128, 16, "bfloat16", 256, 256, 512),
        Case("llama3-8b bq256", 32, 8, 128, 16, "bfloat16", 512, 64, 128, block_q=256),
        Case("mistral-7b", 32, 8, 128, 16, "bfloat16", 512, 64, 256, sliding_window=4096),
        Case("qwen2.5-7b", 28, 4, 128, 16, "bfloat16", 512, 64, 256),
        Case("qwen2-0.5b", 14, 2, 64, 32, "bfloat16", 512, 64, 64),
        Case("qwen3-0.6b", 16, 8, 128, 64, "float32", 512, 64, 32),
        Case("mqa d64", 8, 1, 64, 16, "bfloat16", 128, 64, 128),
        Case("smollm2 step", 9, 3, 64, 16, "bfloat16", 64, 64, 32, layers=2),
        Case("smollm2 step", 9, 3, 64, 16, "bfloat16", 64, 64, 32, layers=2, slab_pool=True),
        Case("llama3-8b step", 32, 8, 128, 16, "bfloat16", 64, 64, 32, layers=2),
        # The runner's choice on TPU: head_dim 64 lane-dense (slab_pool), 128 in pages.
        Case("smollm2 engine", 9, 3, 64, 16, "bfloat16", 64, 64, 32, layers=2, slab_pool=True, engine_step=True),
        Case("llama3-8b engine", 32, 8, 128, 16, "bfloat16", 64, 64, 32, layers=2, engine_step=True),
        Case("llama3-8b 512x8K", 32, 8, 128, 16, "bfloat16", 512, 512, 512, expect_error="scalar memory"),
        # configs/llama3-8b-tpu-v5e-4.yaml: 1024 tokens, 128 seqs, 8K at page 32, one of 4 tensor shards
        Case("llama3-8b tp4 shard", 8, 2, 128, 32, "bfloat16", 1024, 128, 256),
    ]
    c += KV8_CASES
    return c


# 8-bit pools (--kv-cache-dtype int8 / fp8_e4m3), bf16 queries: the default model as the runner
# stores it on TPU (lane-dense, KV write + attention in a layer scan) and Llama-3-8B's head_dim 128.
# An 8-bit tile is 32 sublane rows: SmolLM2's 3 rows per token need page_size 32 (16 is refused).
KV8_CASES = [
    case
    for kv in ("int8", "float8_e4m3fn")
    for case in (
        Case("smollm2 step kv8", 9, 3, 64, 32, "bfloat16", 64, 64, 32, layers=2, slab_pool=True, kv_dtype=kv),
        Case("llama3-8b kv8", 32, 8, 128, 16, "bfloat16", 512, 64, 512, kv_dtype=kv),
    )
] + [
    # The runner's own step (lane-dense pool, its KV write) with an int8 pool.
    Case("smollm2 engine kv8", 9, 3, 64, 32, "bfloat16", 64, 64, 32, layers=2, slab_pool=True, engine_step=True,
         kv_dtype="int8"),
    # The other slab layouts of 8-bit words: f32 q on d64 (4-D pool), MQA d128 (a word straddles
    # two tokens), head_dim 256 with window and soft cap.
    Case("smollm2 kv8", 9, 3, 64, 32, "float32", 512, 64, 64, kv_dtype="int8"),
    Case("mqa d128 kv8", 8, 1, 128, 16, "bfloat16", 128, 64, 128, kv_dtype="float8_e4m3fn"),
    # ... and its step: an 8-bit [N, page, 2, 128] pool is copied twice around the kernel by XLA
    # (its 8-bit tiling of a 2-row minor dim); the lane-dense pool is not.
    Case("mqa d128 step kv8", 8, 1, 128, 16, "bfloat16", 64, 64, 32, layers=2, slab_pool=True,
         kv_dtype="float8_e4m3fn"),
    Case("gemma2-2b kv8", 8, 4, 256, 16, "bfloat16", 512, 64, 512, sliding_window=4096, soft_cap=50.0,
         kv_dtype="int8"),
    Case("smollm2 kv8 page 16", 9, 3, 64, 16, "bfloat16", 64, 64, 128, kv_dtype="int8", expect_error="page_size"),
]
# v4 / v5p: the two models' 8-bit cases (the layouts' code paths are the same on every chip).
KV8_SMALL = [c for c in KV8_CASES if c.name in ("smollm2 step kv8", "llama3-8b kv8")]


CASES = _cases()
# Older/bigger chips: the default model and Llama only (their code paths are the same; the
# limits that differ are VMEM capacity and megacore).
SMALL = [c for c in CASES if c.name in ("smollm2", "llama3-8b") and c.page_size == 16]
# block_q 256 (the raised VMEM limit) only on v5e: on v6e it is the slowest compile and adds no path.
MATRIX: list[tuple[str, Case]] = ([(chip, c) for chip in ("v5e", "v6e") for c in CASES
                                   if not (chip == "v6e" and c.block_q)]
                                  + [(chip, c) for chip in ("v4", "v5p") for c in SMALL if c.dtype == "bfloat16"]
                                  + [(chip, c) for chip in ("v4", "v5p") for c in KV8_SMALL])

_TOPOLOGIES: dict = {}


def libtpu_dir() -> Path:
    """Where scripts/install_libtpu.sh put libtpu for this venv's jax (JAXSERVE_LIBTPU_DIR overrides)."""
    from importlib import metadata

    return Path(os.environ.get("JAXSERVE_LIBTPU_DIR", Path(sys.prefix) / "libtpu" / metadata.version("jax")))


def _setup_env() -> None:
    # libtpu lives beside the venv, not in it (scripts/install_libtpu.sh): on the path of this
    # process and of the spawned workers only.
    extra = str(libtpu_dir())
    if (Path(extra) / "libtpu").is_dir() and extra not in sys.path:
        sys.path.insert(0, extra)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (extra, os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several compile processes at once
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def libtpu_available() -> str | None:
    """None when a TPU topology can be made here, else why not."""
    try:
        import importlib.util

        _setup_env()
        if importlib.util.find_spec("libtpu") is None:
            return f"libtpu is not installed (bash scripts/install_libtpu.sh puts it in {libtpu_dir()})"
        _topology("v5e")
        return None
    except Exception as e:  # noqa: BLE001 - any failure means no deviceless compiler here
        return f"no deviceless TPU topology: {type(e).__name__}: {str(e)[:200]}"


def _topology(chip: str):
    if chip not in _TOPOLOGIES:
        from jax.experimental import topologies

        _TOPOLOGIES[chip] = topologies.get_topology_desc(platform="tpu", topology_name=CHIPS[chip])
    return _TOPOLOGIES[chip]


def _pool_copies(hlo: str, pool_elems: int) -> int:
    """Instructions of at least the pool's size that copy or transpose it: layout changes that
    XLA inserts around the custom call (named copy*/transpose* when fused)."""
    n = 0
    for line in hlo.splitlines():
        m = re.match(r"\s*%(\S+) = \w+\[([\d,]+)\]\S* ([\w-]+)\(", line)
        if not m:
            continue
        name, dims, op = m.groups()
        if op in ("copy", "copy-start", "transpose") or (op == "fusion" and re.match(r"(copy|transpose)", name)):
            size = 1
            for x in dims.split(","):
                size *= int(x)
            n += size >= pool_elems
    return n


def compile_case(chip: str, case: Case) -> dict:
    """Compile one case for one chip; a dict for the table (never raises)."""
    _setup_env()
    import functools

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    rpa = importlib.import_module("jaxserve.pallas_kernels.ragged_paged_attention_tpu")

    out = dict(chip=chip, case=case.name, shape=case.describe(), dtype=case.dtype, status="FAIL",
               error="", seconds=0.0, vmem_used=None, vmem_limit=None, vmem_est=None, smem_est=None,
               pool_copies=None)
    t0 = time.time()
    try:
        dev = _topology(chip).devices[0]
        mesh = Mesh([dev], ("x",))
        sh = NamedSharding(mesh, PartitionSpec())
        dtype = jnp.dtype(case.dtype)
        kv_dtype = jnp.dtype(case.pool_dtype)
        num_pages = 4096
        t, s, p, h, kvh, d, ps = (case.tokens, case.seqs, case.pages, case.heads, case.kv_heads,
                                  case.head_dim, case.page_size)

        def sds(shape, dt):
            return jax.ShapeDtypeStruct(shape, dt, sharding=sh)

        kw = dict(sm_scale=d ** -0.5, sliding_window=case.sliding_window, soft_cap=case.soft_cap,
                  block_q=case.block_q)
        meta = (sds((s,), jnp.int32), sds((s, p), jnp.int32), sds((s + 1,), jnp.int32), sds((1,), jnp.int32))
        if not case.layers:
            fn = functools.partial(rpa.ragged_paged_attention_tpu, **kw)
            args = (sds((t, h, d), dtype), sds((num_pages, ps, 2 * kvh, d), kv_dtype), *meta)
            pool_elems = num_pages * ps * 2 * kvh * d
        elif case.engine_step:
            fn, args, pool_elems = _engine_step(case, kw, sds, meta, num_pages)
        else:
            fn, args, pool_elems = _model_step(case, kw, sds, meta, num_pages)
        with jax.set_mesh(mesh):  # the kernel reads the chip generation from the mesh's device
            plan = rpa.plan_tpu_launch(
                num_tokens=t, num_heads=h, kv_heads=kvh, head_dim=d, page_size=ps, max_seqs=s,
                pages_per_seq=p, q_dtype=dtype, kv_dtype=kv_dtype, block_q=case.block_q)
            out.update(vmem_est=plan.vmem_bytes, smem_est=plan.smem_bytes, vmem_limit=plan.vmem_limit_bytes,
                       blocks=f"{plan.block_q}x{plan.pages_per_block}")
            jitted = fn if case.layers else jax.jit(fn)  # the step is jitted with the pool donated
            compiled = jitted.lower(*args).compile()
        hlo = compiled.as_text()
        used = re.findall(r'"used_scoped_memory_configs":\[\{"memory_space":"1","offset":"\d+","size":"(\d+)"\}\]',
                          next((ln for ln in hlo.splitlines() if "tpu_custom_call" in ln), ""))
        out["vmem_used"] = int(used[0]) if used else None
        out["pool_copies"] = _pool_copies(hlo, pool_elems)
        out["status"] = "UNEXPECTED PASS" if case.expect_error else "PASS"
    except ValueError as e:
        msg = str(e)
        out["error"] = msg[:300]
        if case.expect_error and case.expect_error in msg:
            out["status"] = "PASS (refused)"
    except Exception as e:  # noqa: BLE001 - a compiler error is a result, not a crash
        out["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    out["seconds"] = round(time.time() - t0, 1)
    return out


def _model_step(case: Case, kw: dict, sds, meta, num_pages: int):
    """A step shaped like the engine's: the pool in a layer-scan carry, each layer writing the new
    K/V and then attending. Counts what XLA does to the pool around the custom call."""
    import jax
    import jax.numpy as jnp

    from jaxserve.attention import write_kv
    rpa = importlib.import_module("jaxserve.pallas_kernels.ragged_paged_attention_tpu")

    t, h, kvh, d, ps, L = case.tokens, case.heads, case.kv_heads, case.head_dim, case.page_size, case.layers
    dtype, kv_dtype = jnp.dtype(case.dtype), jnp.dtype(case.pool_dtype)
    rows = ps * 2 * kvh * d // 128
    if case.slab_pool:
        pool_shape = (L * num_pages, rows, 128)
    else:
        pool_shape = (L * num_pages, ps, 2 * kvh, d)

    def step(q, pool, kv_lens, pt, cu, ns, slots):
        def layer(pool, l):
            k = (q[:, :kvh] * (l + 1)).astype(kv_dtype)  # 8-bit: the caller's rounding stands in here
            v = (q[:, :kvh] * (l + 2)).astype(kv_dtype)
            if case.slab_pool:
                pool = rpa.write_kv_rows(pool, k, v, slots + l * num_pages * ps, ps)
                o = rpa.ragged_paged_attention_tpu(q, pool, kv_lens, pt + l * num_pages, cu, ns,
                                                   pool_page_size=ps, **kw)
            else:
                pool = write_kv(pool, k, v, slots + l * num_pages * ps)
                o = rpa.ragged_paged_attention_tpu(q, pool, kv_lens, pt + l * num_pages, cu, ns, **kw)
            return pool, o.sum()

        return jax.lax.scan(layer, pool, jnp.arange(L))

    fn = jax.jit(step, donate_argnums=(1,))
    args = (sds((t, h, d), dtype), sds(pool_shape, kv_dtype), *meta, sds((t,), jnp.int32))
    return fn, args, L * num_pages * rows * 128


def _engine_step(case: Case, kw: dict, sds, meta, num_pages: int):
    """The engine's step as the runner builds it on a TPU: LlamaForCausalLM (hidden 256, the case's
    heads), the pool in the layout `attention.pool_layout` picks there, the layout's attention and
    KV-write functions, the pool donated. Counts what XLA does to the pool around the kernel."""
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve import attention
    from jaxserve.models.llama import LlamaForCausalLM, ModelConfig
    rpa = importlib.import_module("jaxserve.pallas_kernels.ragged_paged_attention_tpu")

    dtype = jnp.dtype(case.dtype)
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=256, intermediate_size=256,
                      num_layers=case.layers, num_heads=case.heads, num_kv_heads=case.kv_heads,
                      head_dim=case.head_dim)
    layout = attention.pool_layout("pallas", cfg.head_dim, cfg.num_kv_heads, platform="tpu")
    if (layout == attention.KV_LAYOUT_LANES) != case.slab_pool:
        raise AssertionError(f"pool_layout chose {layout!r} for this case on TPU")
    shape = attention.pool_shape(layout, cfg.num_layers, num_pages, case.page_size, cfg.num_kv_heads, cfg.head_dim)

    def tpu_attention(q, pool, kv_lens, pt, cu, ns, *, k_new=None, v_new=None, **kw2):
        return rpa.ragged_paged_attention_tpu(q, pool, kv_lens, pt, cu, ns, **kw2)

    attention_fn, kv_write_fn = attention.with_pool_layout(
        functools.partial(tpu_attention, block_q=kw["block_q"]), attention.write_kv, layout, case.page_size)
    graphdef, state = nnx.split(LlamaForCausalLM(cfg, dtype, rngs=nnx.Rngs(0)))

    def step(state, pool, tokens, positions, slots, kv_lens, pt, cu, ns):
        model = nnx.merge(graphdef, state)
        md = attention.AttentionMetadata(positions, slots, kv_lens, pt, cu, ns)
        hidden, pool = model(tokens, md, pool, attention_fn, kv_write_fn, page_size=case.page_size)
        return pool, model.compute_logits(hidden[:1])

    t = case.tokens
    abstract_state = jax.tree.map(lambda a: sds(a.shape, a.dtype), state)
    i32 = sds((t,), jnp.int32)
    kv_lens, pt, cu, ns = meta
    args = (abstract_state, sds(shape, jnp.dtype(case.pool_dtype)), i32, i32, i32, kv_lens, pt, cu, ns)
    return jax.jit(step, donate_argnums=(1,)), args, math.prod(shape)


# Decode roofline: per-element VPU work of compute_block, counted from the kernel's code (ops on
# 32-bit lanes; the EUP's exp counted as one op): per score element of each head (scale, mask
# select, max, subtract, exp, sum, cast of p), per score element once per block (row/column
# iotas and compares of the mask), per 128-lane K/V row of each head (word load, shift/and,
# two zeroing selects, two casts to bf16).
VPU_PER_SCORE, VPU_PER_MASK, VPU_PER_KV_ROW = 7, 14, 7
CHIP_PEAKS = {"v5e": (8.20e11, 1.97e14), "v6e": (1.64e12, 9.20e14)}  # HBM B/s, bf16 FLOP/s (jax tpu_info)


def decode_roofline(chip: str, batch: int = 128, context: int = 8192, page_size: int = 16) -> dict:
    """Llama-3-8B decode (32/8/128, bf16), one layer, from the kernel's own plan and counts."""
    _setup_env()
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    rpa = importlib.import_module("jaxserve.pallas_kernels.ragged_paged_attention_tpu")
    h, kvh, d = 32, 8, 128
    mesh = Mesh([_topology(chip).devices[0]], ("x",))
    with jax.set_mesh(mesh):
        plan = rpa.plan_tpu_launch(num_tokens=batch, num_heads=h, kv_heads=kvh, head_dim=d, page_size=page_size,
                                   max_seqs=batch, pages_per_seq=context // page_size, q_dtype=jnp.bfloat16,
                                   kv_dtype=jnp.bfloat16)
    bw, flops = CHIP_PEAKS[chip]
    kv_tokens = batch * context
    kv_bytes = kv_tokens * 2 * kvh * d * 2
    qo_bytes = 2 * batch * h * d * 2
    table_bytes = batch * (context // page_size) * 4
    hbm = kv_bytes + qo_bytes + table_bytes
    nr = plan.narrow_rows  # decode rows computed per head (group 4 -> one 32-row bf16 window)
    mxu = kv_tokens * kvh * 4 * nr * d  # QK^T and PV as issued
    useful = kv_tokens * kvh * 4 * (h // kvh) * d
    rows_per_head = plan.head_dim // 128 * 2 // 2  # word rows per token per head (bf16: K and V share)
    vpu = kv_tokens * (kvh * (VPU_PER_SCORE * nr + VPU_PER_KV_ROW * 128 * rows_per_head) + VPU_PER_MASK * nr)
    blk_tokens = plan.pages_per_block * page_size
    t_hbm = hbm / bw
    t_blk = blk_tokens * 2 * kvh * d * 2 / bw  # one KV block's DMA
    vreg_ops_blk = vpu / kv_tokens * blk_tokens / 1024
    return dict(chip=chip, blocks=f"{plan.block_q} q x {blk_tokens} KV tokens", hbm_bytes=hbm, t_hbm_ms=t_hbm * 1e3,
                mxu_flops=mxu, useful_flops=useful, t_mxu_ms=mxu / flops * 1e3,
                vpu_ops_per_byte=vpu / hbm, t_block_dma_us=t_blk * 1e6, vreg_ops_per_block=vreg_ops_blk,
                # VPU vreg-ops per ns needed to hide a block's compute under its DMA
                vreg_ops_per_ns_needed=vreg_ops_blk / (t_blk * 1e9),
                # v5e and v6e prefetch across grid steps: only the kernel's first KV block waits
                # (without it, the first block of every query block did: ceil(batch / block_q)).
                exposed_first_dma=t_blk / t_hbm,
                exposed_without_cross_step=(-(-batch // plan.block_q)) * t_blk / t_hbm)


def roofline_table() -> str:
    lines = ["| chip | blocks | HBM bytes / layer | t at HBM peak | MXU FLOPs issued (useful) | t at MXU peak | "
             "VPU ops per HBM byte | one KV block: DMA / VPU vreg-ops | VPU rate to stay HBM-bound | exposed DMA (without cross-step prefetch) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for chip in CHIP_PEAKS:
        r = decode_roofline(chip)
        lines.append(
            f"| {chip} | {r['blocks']} | {r['hbm_bytes'] / 2**30:.2f} GiB | {r['t_hbm_ms']:.2f} ms | "
            f"{r['mxu_flops'] / 1e9:.0f} G ({r['useful_flops'] / 1e9:.0f} G) | {r['t_mxu_ms']:.2f} ms | "
            f"{r['vpu_ops_per_byte']:.2f} | {r['t_block_dma_us']:.2f} us / {r['vreg_ops_per_block']:.0f} | "
            f"{r['vreg_ops_per_ns_needed']:.2f} vreg-ops/ns | {100 * r['exposed_first_dma']:.3f}% "
            f"({100 * r['exposed_without_cross_step']:.2f}%) |")
    return "\n".join(lines)


def run_matrix(matrix=None, workers: int = 2) -> list[dict]:
    matrix = MATRIX if matrix is None else matrix
    if workers <= 1:
        return [compile_case(chip, c) for chip, c in matrix]
    # spawn, not fork: libtpu is already initialised in this process, and a forked copy crashes.
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_setup_env) as ex:
        return list(ex.map(compile_case, [m[0] for m in matrix], [m[1] for m in matrix]))


def _mib(x) -> str:
    return "" if x is None else f"{x / 2**20:.1f}"


def table(results: list[dict]) -> str:
    lines = ["| chip | case | shape (H/KVH/D, page, T, S, P) | dtype | result | blocks (q x pages) | "
             "VMEM used / est. / limit (MiB) | SMEM est. (KiB) | pool copies | compile s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        res = r["status"] if r["status"].startswith("PASS") else f"{r['status']}: {r['error'][:120]}"
        if r["status"] == "PASS (refused)":
            res += f": {r['error'][:140]}"
        vm = f"{_mib(r['vmem_used'])} / {_mib(r['vmem_est'])} / {_mib(r['vmem_limit'])}" if r["vmem_est"] else ""
        sm = "" if r["smem_est"] is None else f"{r['smem_est'] / 1024:.0f}"
        pc = "" if r["pool_copies"] is None else str(r["pool_copies"])
        lines.append(f"| {r['chip']} | {r['case']} | {r['shape']} | {r['dtype']} | {res.replace('|', '/')} | "
                     f"{r.get('blocks', '')} | {vm} | {sm} | {pc} | {r['seconds']} |")
    return "\n".join(lines)


def _replace_between(text: str, begin: str, end: str, body: str) -> str:
    if begin in text and end in text:
        return text[:text.index(begin)] + f"{begin}\n{body}\n{end}" + text[text.index(end) + len(end):]
    return text + f"\n{begin}\n{body}\n{end}\n"


def write_docs(results: list[dict] | None, roofline: bool = True) -> None:
    """Refresh the generated tables of docs/kernels.md (between their markers)."""
    import jax

    try:
        import importlib.metadata as md

        libtpu = md.version("libtpu")
    except Exception:  # noqa: BLE001
        libtpu = "?"
    text = DOCS.read_text() if DOCS.exists() else "# Kernels\n\n"
    if results is not None:
        n_ok = sum(r["status"].startswith("PASS") for r in results)
        body = (f"Generated by `python scripts/tpu_compile_matrix.py --write-docs` (jax {jax.__version__}, "
                f"libtpu {libtpu}; deviceless compiles on a 2-core CPU host shared with other jobs, so the "
                f"compile times are loaded ones). {n_ok} of {len(results)} pass.\n\n{table(results)}")
        text = _replace_between(text, BEGIN, END, body)
    if roofline:
        text = _replace_between(text, "<!-- tpu-roofline:begin -->", "<!-- tpu-roofline:end -->", roofline_table())
    DOCS.write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chips", default="", help="comma-separated subset of " + ",".join(CHIPS))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", default="")
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--roofline", action="store_true", help="print the decode roofline table only")
    ap.add_argument("--from-json", default="", help="with --write-docs: take results saved by --json")
    args = ap.parse_args()
    _setup_env()
    sys.path.insert(0, str(ROOT))
    why = libtpu_available()
    if why:
        print(f"cannot compile for TPU here: {why}", file=sys.stderr)
        return 2
    if args.roofline:
        print(roofline_table())
        if args.write_docs:
            write_docs(None)
        return 0
    matrix = MATRIX
    if args.chips:
        keep = set(args.chips.split(","))
        matrix = [m for m in matrix if m[0] in keep]
    t0 = time.time()
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        results = run_matrix(matrix, args.workers)
    print(table(results))
    bad = [r for r in results if not r["status"].startswith("PASS")]
    print(f"\n{len(results) - len(bad)} passed, {len(bad)} failed in {time.time() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.write_docs:
        write_docs(results)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
