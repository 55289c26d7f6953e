"""The CPU stacked-weight matmul kernel (jaxserve/cpu_kernels/stacked_matmul.cc, opt-in:
--cpu-dense-kernel) against numpy, and the model with it against the model on XLA's dots:
decode-sized steps use the kernel, larger ones XLA, and both give the same logits (float32
rounding apart), and the engine option turns it on."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_ARCHS
from model_utils import prefill_logits

from jaxserve.cpu_kernels import stacked
from jaxserve.loading import load_weights
from jaxserve.models.llama import LlamaForCausalLM, resolve_dense_impl

pytestmark = pytest.mark.skipif(not stacked.available(), reason="no C++ compiler: the kernel cannot be built")


@pytest.mark.parametrize("rows, n_in, out", [
    (1, 576, 1536), (3, 64, 200), (4, 130, 512), (7, 1536, 576), (16, 576, 192), (17, 33, 1030),
])
def test_kernel_matches_reference(rows, n_in, out):
    """Every row-block size (1-4 and a ragged rest), inputs not a multiple of 4, outputs past one
    512-wide work item and not a multiple of it; each layer of the stack is the one read."""
    rng = np.random.default_rng(rows * 1000 + out)
    x = rng.standard_normal((rows, n_in), dtype=np.float32)
    w = rng.standard_normal((3, n_in, out), dtype=np.float32)
    for layer in range(3):
        y = np.asarray(jax.jit(stacked.stacked_matmul_cpu)(jnp.asarray(x), jnp.asarray(w), jnp.int32(layer)))
        ref = stacked.stacked_matmul_reference(x, w, layer)
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * np.sqrt(n_in))


def test_kernel_inside_a_scan_reads_each_layer():
    """As the model calls it: the layer index is the scan's traced counter."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((4, 32, 32), dtype=np.float32) / 6)
    x = jnp.asarray(rng.standard_normal((2, 32), dtype=np.float32))

    def run(use_kernel: bool) -> jax.Array:
        def body(h, l):
            return (stacked.stacked_matmul_cpu(h, w, l) if use_kernel else h @ w[l]), None
        return jax.lax.scan(body, x, jnp.arange(4, dtype=jnp.int32))[0]

    np.testing.assert_allclose(np.asarray(jax.jit(lambda: run(True))()), np.asarray(run(False)), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="float32"):
        stacked.stacked_matmul_cpu(jnp.zeros((1, 4), jnp.bfloat16), jnp.zeros((1, 4, 4)), 0)
    with pytest.raises(ValueError, match="do not fit"):
        stacked.stacked_matmul_cpu(jnp.zeros((1, 5)), jnp.zeros((1, 4, 4)), 0)
    with pytest.raises(ValueError, match="dense linear impl"):
        resolve_dense_impl("blas", jnp.zeros((1, 4, 4)))
    assert resolve_dense_impl("auto", jnp.zeros((1, 4, 4), jnp.bfloat16)) == "xla"  # float32 only


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_model_logits_equal_xla_at_every_step_size(arch, tiny_checkpoints):
    """Steps of 1, 5 and 8 rows run on the kernel, 16 and 40 rows on XLA's dots: logits as XLA's."""
    cfg, params = load_weights(tiny_checkpoints[arch])
    arrays = {k: jnp.asarray(v) for k, v in params.items()}
    kernel = LlamaForCausalLM.from_arrays(cfg, arrays, dense_impl="auto")
    xla = LlamaForCausalLM.from_arrays(cfg, arrays)  # (the default)
    assert kernel.dense_impl == "cpu_kernel" and xla.dense_impl == "xla"
    rng = np.random.default_rng(1)
    for lengths in ([1], [5], [3, 5], [9, 7], [40]):
        prompts = [rng.integers(1, cfg.vocab_size, n).tolist() for n in lengths]
        for a, b in zip(prefill_logits(kernel, prompts), prefill_logits(xla, prompts)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_engine_option_turns_the_kernel_on(tiny_checkpoints):
    """Off by default (batch invariance: see EngineConfig.cpu_dense_kernel); on, greedy tokens equal
    the default engine's on a short run."""
    from conftest import small_engine_options

    from jaxserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = {}
    for on in (False, True):
        llm = LLM(model=str(tiny_checkpoints["llama3"]), cpu_dense_kernel=on, **small_engine_options())
        assert llm.engine.runner.model.dense_impl == ("cpu_kernel" if on else "xla")
        outs[on] = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7, 8], [9, 10]], params, use_tqdm=False)]
        llm.engine.close()
    assert outs[True] == outs[False]
