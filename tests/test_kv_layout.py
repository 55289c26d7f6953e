"""The lane-dense KV pool (what the runner stores on TPU for head_dim < 128) against the 4-D one.

On a TPU the choice removes the whole-pool copies XLA puts around the kernel for a 64-wide minor
dim (compiled and counted in tests/test_tpu_compile.py: the engine step has 0). Here, on CPU, the
same engine runs with the layout forced: the Pallas backend then views the lane-dense pool back as
pages (a free reshape off TPU), so greedy tokens must equal the 4-D pool's exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention import KV_LAYOUT_LANES, KV_LAYOUT_PAGES, pool_layout, pool_shape, write_kv
from jaxserve.pallas_kernels.ragged_paged_attention_tpu import write_kv_rows


@pytest.mark.parametrize("backend, platform, head_dim, kv_heads, tp, expect", [
    ("pallas", "tpu", 64, 3, 1, KV_LAYOUT_LANES),   # SmolLM2
    ("auto", "tpu", 64, 1, 1, KV_LAYOUT_LANES),     # MQA: K|V of the one head fill 128 lanes
    ("pallas", "tpu", 128, 8, 1, KV_LAYOUT_PAGES),  # already lane-dense
    ("pallas", "tpu", 64, 3, 4, KV_LAYOUT_PAGES),   # tensor parallel splits the head axis
    ("xla", "tpu", 64, 3, 1, KV_LAYOUT_PAGES),      # the XLA paths read pages
    ("pallas", "gpu", 64, 3, 1, KV_LAYOUT_PAGES),
    ("auto", "cpu", 64, 3, 1, KV_LAYOUT_PAGES),
    ("pallas", "tpu", 32, 1, 1, KV_LAYOUT_PAGES),   # 2 x 1 x 32 = 64 lanes: no whole row
])
def test_pool_layout_choice(backend, platform, head_dim, kv_heads, tp, expect):
    assert pool_layout(backend, head_dim, kv_heads, tp, platform=platform) == expect


def test_lane_dense_pool_holds_the_same_bytes():
    L, N, page, kvh, d = 2, 5, 16, 3, 64
    assert pool_shape(KV_LAYOUT_LANES, L, N, page, kvh, d) == (L, N, page * 3, 128)
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((7, kvh, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((7, kvh, d)), jnp.float32)
    slots = jnp.asarray([16, 17, 40, 41, 79, 3, 50], jnp.int32)
    pages = write_kv(jnp.zeros((N, page, 2 * kvh, d)), k, v, slots)
    lanes = write_kv_rows(jnp.zeros((N, page * 3, 128)), k, v, slots, page_size=page)
    np.testing.assert_array_equal(np.asarray(lanes).reshape(pages.shape), np.asarray(pages))


def test_engine_with_lane_dense_pool_equals_pages(tmp_path, monkeypatch):
    from jaxserve import LLM, SamplingParams
    from jaxserve.engine import runner as runner_mod

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from device_check import write_tiny_checkpoint  # a random Llama with numpy alone

    model = write_tiny_checkpoint(tmp_path / "tiny", hidden=192, heads=6, kv_heads=3, head_dim=64)
    prompts = [[1] + [(7 * i + 13 * j) % 250 + 3 for j in range(5 + 11 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    opts = dict(model=str(model), dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96,
                page_size=16, num_pages=40, enable_prefix_caching=True, compilation_cache_dir=None,
                attention_backend="pallas", show_progress=False)
    tokens = {}
    for layout in (KV_LAYOUT_PAGES, KV_LAYOUT_LANES):
        monkeypatch.setattr(runner_mod, "pool_layout", lambda *a, layout=layout, **k: layout)
        llm = LLM(**opts)
        assert llm.engine.runner.kv_layout == layout
        assert llm.engine.runner.kv_cache.shape == pool_shape(layout, 2, 40, 16, 3, 64)
        tokens[layout] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.runner.compiles_after_warmup == 0
        del llm
    assert all(len(t) == 12 for t in tokens[KV_LAYOUT_PAGES])
    assert tokens[KV_LAYOUT_LANES] == tokens[KV_LAYOUT_PAGES]
