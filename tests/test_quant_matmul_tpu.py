"""The Pallas TPU quantized matmul (jaxserve/pallas_kernels/quant_matmul_tpu.py) in interpret mode,
against the float64 reference, for the three stored formats. Its compilation by the real TPU
compiler is checked in tests/test_quant_compile.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import quantization as quant
from jaxserve.pallas_kernels.quant_matmul_tpu import VMEM_BUDGET, block_sizes, quant_matmul_tpu, vmem_bytes

FORMATS = ("int8", "int8_affine", "4bit")


def _weights(fmt: str, out: int, n_in: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q, s, m = quant.quantize(rng.standard_normal((n_in, out)).astype(np.float32))
    if fmt == "int8":
        m = None
    elif fmt == "4bit":  # Q4_1-like: values 0..15, scale and offset per group
        q = quant.pack_q4(rng.integers(0, 16, (out, n_in)))
        s = (rng.random(s.shape, np.float32) * 0.1 + 0.01).astype(np.float32)
        m = (rng.standard_normal(s.shape) * 0.1 - 8 * s).astype(np.float32)
    return q, s, m


def _run(x, q, s, m, block=None):
    args = [jnp.asarray(a) for a in (x, q, s)]
    return np.asarray(quant_matmul_tpu(*args, None if m is None else jnp.asarray(m), interpret=True, block=block),
                      np.float32)


# (rows, out, in, block): ragged row counts; 576 inputs (SmolLM2: a partial 128-lane chunk);
# several k blocks (the accumulator across grid steps) and out blocks; > 512 rows (partial row block).
CASES = [
    (1, 128, 576, None),
    (3, 256, 512, (3, 128, 128)),
    (8, 384, 1024, (8, 128, 256)),
    (37, 576, 256, None),
    (130, 128, 512, (130, 128, 256)),
    (600, 128, 256, None),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows,out,n_in,block", CASES)
def test_matches_reference_float32(fmt, rows, out, n_in, block):
    q, s, m = _weights(fmt, out, n_in)
    x = np.random.default_rng(1).standard_normal((rows, n_in)).astype(np.float32)
    ref = quant.linear_reference(x, q, s, m)
    y = _run(x, q, s, m, block)
    assert y.shape == (rows, out)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("fmt", FORMATS)
def test_bfloat16_activations(fmt):
    rows, out, n_in = 8, 256, 512
    q, s, m = _weights(fmt, out, n_in)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((rows, n_in)), jnp.bfloat16)
    ref = quant.linear_reference(np.asarray(x, np.float32), q, s, m)
    y = quant_matmul_tpu(x, jnp.asarray(q), jnp.asarray(s), None if m is None else jnp.asarray(m),
                         interpret=True, block=(8, 128, 256))
    assert y.dtype == jnp.bfloat16
    # bf16 weights on the MXU (as XLA's path) and a bf16 result: ~3 significant digits
    err = np.abs(np.asarray(y, np.float32) - ref).max() / np.abs(ref).max()
    assert err < 2e-2, err


def test_block_sizes_for_real_models():
    # Llama-3-8B up/down, q/o, k/v and SmolLM2's MLP at decode and prefill row counts
    assert block_sizes(8, 14336, 4096, False) == (8, 512, 2048)
    assert block_sizes(512, 4096, 14336, False) == (512, 512, 1024)
    assert block_sizes(8, 4096, 14336, True) == (8, 512, 2048)
    assert block_sizes(64, 1024, 4096, True) == (64, 512, 4096)
    assert block_sizes(512, 14336, 4096, True) == (512, 512, 2048)
    for rows in (8, 512, 1000):  # within TPU v4's 16 MiB of VMEM
        for out, n_in in ((14336, 4096), (4096, 14336), (1024, 4096)):
            for packed in (False, True):
                assert vmem_bytes(*block_sizes(rows, out, n_in, packed), n_in, packed, True, 2) <= VMEM_BUDGET
    assert block_sizes(8, 576, 1536, False) == (8, 576, 512)
    assert block_sizes(8, 1536, 576, True) == (8, 512, 576)
    assert block_sizes(1000, 4096, 4096, False)[0] == 256


def test_rejects_mismatched_shapes():
    q, s, m = _weights("int8_affine", 128, 256)
    with pytest.raises(ValueError):
        quant_matmul_tpu(jnp.zeros((2, 512), jnp.float32), jnp.asarray(q), jnp.asarray(s), jnp.asarray(m),
                         interpret=True)


def test_cpu_dispatch_unchanged():
    q = jnp.zeros((128, 256), jnp.int8)
    assert not quant.on_one_tpu(q)
    assert quant.resolve_impl("auto", q) in ("kernel", "xla")
    assert quant.resolve_impl("pallas_tpu", q) == "pallas_tpu"
    with pytest.raises(ValueError):
        quant.resolve_impl("bogus", q)


def test_linear_routes_to_the_kernel(monkeypatch):
    """linear(impl="pallas_tpu") flattens leading axes, calls the kernel and restores them."""
    import jaxserve.pallas_kernels.quant_matmul_tpu as mod

    real = mod.quant_matmul_tpu
    monkeypatch.setattr(mod, "quant_matmul_tpu", lambda x, q, s, m, layer=None: real(x, q, s, m, layer, interpret=True))
    q, s, m = _weights("int8_affine", 128, 256)
    x = np.random.default_rng(3).standard_normal((2, 3, 256)).astype(np.float32)
    y = quant.linear(jnp.asarray(x), jnp.asarray(q), jnp.asarray(s), jnp.asarray(m), impl="pallas_tpu")
    ref = quant.linear_reference(x.reshape(6, 256), q, s, m).reshape(2, 3, 128)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    assert jax.numpy.shape(y) == (2, 3, 128)


@pytest.mark.parametrize("fmt", FORMATS)
def test_reads_a_layer_of_stacked_weights(fmt):
    """layer=: the index maps pick the layer (scalar prefetch), inside a scan over layers as the
    model calls it; each layer's result equals the kernel on that layer's weights alone."""
    layers = [_weights(fmt, 128, 256, seed=l) for l in range(3)]
    q, s = (jnp.stack([jnp.asarray(w[i]) for w in layers]) for i in (0, 1))
    m = None if fmt == "int8" else jnp.stack([jnp.asarray(w[2]) for w in layers])
    x = jnp.asarray(np.random.default_rng(4).standard_normal((5, 256)), jnp.float32)

    def body(carry, l):
        return carry, quant_matmul_tpu(x, q, s, m, l, interpret=True)

    _, ys = jax.lax.scan(body, 0, jnp.arange(3))
    for l, (ql, sl, ml) in enumerate(layers):
        np.testing.assert_allclose(np.asarray(ys[l]), _run(np.asarray(x), ql, sl, ml), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scale_dtype", ["float32", "float16"])
def test_model_on_the_kernel_matches_xla(tiny_checkpoints, monkeypatch, scale_dtype):
    """A tiny int8 model through linear(impl="pallas_tpu") (interpret mode): the model hands the
    kernel its stacked weights and the layer index; logits equal the XLA path's. float16 scales
    (GGUF's) are widened for the kernel when the model is built."""
    import jaxserve.pallas_kernels.quant_matmul_tpu as mod
    from model_utils import prefill_logits

    from jaxserve.loading import load_weights
    from jaxserve.models.llama import LlamaForCausalLM

    real = mod.quant_matmul_tpu
    calls = []

    def interpreted(x, q, s, m, layer=None):
        assert s.dtype == jnp.float32 and (m is None or m.dtype == jnp.float32)
        calls.append(q.ndim)
        return real(x, q, s, m, layer, interpret=True)

    monkeypatch.setattr(mod, "quant_matmul_tpu", interpreted)
    cfg, params = load_weights(tiny_checkpoints["llama3"], use_cache=False)
    qp = {k: jnp.asarray(v.astype(scale_dtype) if k.endswith(("_scale", "_offset")) else v)
          for k, v in quant.quantize_params(cfg, params).items()}
    prompts = [[5, 9, 200, 31, 7], list(range(3, 40))]
    logits = {impl: prefill_logits(LlamaForCausalLM.from_arrays(cfg, qp, quantization="int8", quant_impl=impl),
                                   prompts) for impl in ("pallas_tpu", "xla")}
    # the seven linears of a layer get the stacked [L, out, in] weights (read in place); the LM head is 2-D
    assert calls.count(3) >= 7 and set(calls) <= {2, 3}, calls
    for a, b in zip(logits["pallas_tpu"], logits["xla"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
