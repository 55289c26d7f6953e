"""The TPU attention kernel compiled by the real Mosaic compiler (libtpu), no TPU attached.

Lowering alone accepts shapes that Mosaic's layout rules reject, so every case here is compiled
against a deviceless TPU topology (v5e and v6e in full, v4 and v5p for the default model and
Llama-3-8B): every architecture we load, head_dim 64/128/256, bf16 and f32, pages 16/32/64, the
engine's largest buckets, 8-bit pools (int8, float8_e4m3fn) for the default model's lane-dense
step and Llama-3-8B, a block_q that needs the raised VMEM limit, a model-like step whose
HLO is checked for whole-pool copies, and a page table too big for scalar memory that must be
refused up front. The compiles run once, in a subprocess with two workers
(scripts/tpu_compile_matrix.py, which also writes the table in docs/kernels.md); each case is
then its own test. Skipped (with the reason in the -ra summary) only when libtpu is not
installed beside the venv: ``bash scripts/install_libtpu.sh`` (``make test`` runs it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import tpu_compile_matrix as tcm  # noqa: E402  (plain data and helpers; jax is imported lazily)

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("libtpu") is None and not (tcm.libtpu_dir() / "libtpu").is_dir(),
        reason=f"libtpu not installed: the TPU compile check needs it in {tcm.libtpu_dir()} "
               "(bash scripts/install_libtpu.sh; make test does it)"),
    # The module fixture compiles the whole matrix inside the first test's time: ~200 s of CPU on
    # two workers, 13 min wall measured on this 2-core host while other jobs loaded it.
    pytest.mark.timeout(2400),
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[tuple[str, str, str, str], dict]:
    out = tmp_path_factory.mktemp("tpu_compile") / "matrix.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "tpu_compile_matrix.py"), "--json", str(out),
                           "--workers", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=2300)
    if not out.exists():  # libtpu is installed, so a missing result is a failure, not a skip
        pytest.fail(f"tpu_compile_matrix.py exited {proc.returncode} without results:\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(proc.stdout)
    return {(r["chip"], r["case"], r["shape"], r["dtype"]): r for r in json.loads(out.read_text())}


def _id(entry: tuple[str, tcm.Case]) -> str:
    chip, c = entry
    return f"{chip}-{c.name.replace(' ', '_')}-{c.describe().replace(' ', '_')}-{c.dtype}"


@pytest.mark.parametrize("entry", tcm.MATRIX, ids=[_id(e) for e in tcm.MATRIX])
def test_tpu_kernel_compiles(entry, results):
    chip, case = entry
    r = results[(chip, case.name, case.describe(), case.dtype)]
    assert r["status"].startswith("PASS"), f"{r['status']}: {r['error']}"
    if case.expect_error:
        assert r["status"] == "PASS (refused)"
        return
    # The estimate that sets the scoped VMEM limit must cover what Mosaic really allocates.
    if r["vmem_used"] is not None:
        assert r["vmem_used"] <= r["vmem_limit"], r
    if case.layers and (case.slab_pool or case.head_dim >= 128):
        # The engine-shaped step: the pool stays in place across the custom call.
        assert r["pool_copies"] == 0, f"{r['pool_copies']} whole-pool copies around the kernel"
