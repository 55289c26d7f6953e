"""Weight-only quantization (--quantization int8, --quantization gguf): the CPU kernel in each
format against the numpy reference, quantized models against float32 ones (bounds from
measurement, see docs/quantization.md), GGUF weights served in their own quantization, the engine
end to end, a 1x2 mesh against 1x1, and configuration errors."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_ARCHS, small_engine_options
from model_utils import prefill_logits, teacher_forced_gap

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig, add_engine_args, config_from_args
from jaxserve.cpu_kernels import quant_matmul as kernel
from jaxserve.loading import load_tokenizer, load_weights
from jaxserve.models.llama import LlamaForCausalLM, ModelConfig
from jaxserve.quantization import (GROUP, dequantize, dequantize_params, linear, linear_reference, pack_q4,
                                   quantize, quantize_params, quantized_names, unpack_q4)

TEXTS = Path(__file__).parent / "data" / "quant_texts.json"
FORMATS = ["q8", "q8a", "q4a"]  # int8, int8 + offsets, packed 4-bit + offsets (see quant_matmul.cc)


def random_quantized(rng, out: int, n_in: int, fmt: str = "q8") -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    s = (rng.random((out, n_in // GROUP), dtype=np.float32) + 0.05) * 0.01
    m = (rng.standard_normal((out, n_in // GROUP)) * 0.1).astype(np.float32)
    if fmt == "q4a":
        return pack_q4(rng.integers(0, 16, (out, n_in))), s, m
    q = rng.integers(-128, 128, (out, n_in), dtype=np.int8)
    return q, s, (m if fmt == "q8a" else None)


def as_jnp(*arrays):
    return tuple(None if a is None else jnp.asarray(a) for a in arrays)


def isas() -> list[str]:
    order = ["portable", "avx2", "avx512"]
    return order[: order.index(kernel.best_isa()) + 1] if kernel.available() else []


# --- the kernel ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows, n_in, out", [
    (1, 32, 1), (1, 64, 5), (2, 96, 7), (3, 576, 576), (4, 576, 192), (5, 128, 67), (8, 1536, 576),
    (15, 64, 8), (16, 96, 9), (17, 576, 1536), (64, 64, 130), (100, 256, 64), (128, 576, 576), (129, 64, 9),
])
def test_kernel_matches_reference(rows, n_in, out, fmt):
    """Few rows convert each weight vector in the micro-kernel; 16 and more (a work item's rows)
    convert a float panel first: both paths, every format, every instruction set this CPU has."""
    if not kernel.available():
        pytest.skip("no C++ compiler: the CPU quantized kernel cannot be built")
    rng = np.random.default_rng(rows * 1000 + out)
    x = rng.standard_normal((rows, n_in), dtype=np.float32)
    w = random_quantized(rng, out, n_in, fmt)
    ref = linear_reference(x, *w)
    for isa in isas():  # every path this CPU can run, so a machine without AVX-512 still tests the others
        y = np.asarray(jax.jit(lambda x: kernel.quant_matmul_cpu(x, *as_jnp(*w), isa=isa))(x))
        assert y.shape == (rows, out)
        assert np.abs(y - ref).max() <= 2e-6 * np.abs(ref).max() + 1e-7, isa
    single = kernel.quant_matmul_cpu(jnp.asarray(x), *as_jnp(*w), threads=1)
    assert np.abs(np.asarray(single) - ref).max() <= 2e-6 * np.abs(ref).max() + 1e-7


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_kernel_float16_scales_are_their_float32_values(fmt, rows):
    """Scales and offsets stored as float16 (GGUF's own) give, bit for bit, what the same values
    as float32 give, on every instruction set (F16C's conversion and the portable one), the
    subnormal and zero halves included; and in a stacked call."""
    if not kernel.available():
        pytest.skip("no C++ compiler")
    rng = np.random.default_rng(rows)
    q, s, m = random_quantized(rng, 70, 96, fmt)
    s16 = s.astype(np.float16)
    s16.flat[:3] = np.array([0.0, 6e-8, 3e-5], np.float16)  # zero, the smallest subnormal, a subnormal
    m16 = None if m is None else m.astype(np.float16)
    x = jnp.asarray(rng.standard_normal((rows, 96), dtype=np.float32))
    for isa in isas():
        half = kernel.quant_matmul_cpu(x, *as_jnp(q, s16, m16), isa=isa)
        widened = (q, s16.astype(np.float32), None if m16 is None else m16.astype(np.float32))
        full = kernel.quant_matmul_cpu(x, *as_jnp(*widened), isa=isa)
        assert np.array_equal(np.asarray(half), np.asarray(full)), isa
    stacked = tuple(None if a is None else jnp.asarray(np.stack([a, a])) for a in (q, s16, m16))
    np.testing.assert_array_equal(np.asarray(kernel.quant_matmul_cpu(x, *stacked, layer=1)), np.asarray(half))
    if m is not None:
        with pytest.raises(ValueError, match="offsets of the scales' dtype"):
            kernel.quant_matmul_cpu(x, *as_jnp(q, s16, m))


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_rows_are_independent_of_the_batch(fmt):
    """A row's result must not depend on which other rows share the call (continuous batching):
    rows below the panel threshold and above it must give the same bits."""
    if not kernel.available():
        pytest.skip("no C++ compiler")
    rng = np.random.default_rng(3)
    w = as_jnp(*random_quantized(rng, 576, 576, fmt))
    x = jnp.asarray(rng.standard_normal((37, 576), dtype=np.float32))
    full = np.asarray(kernel.quant_matmul_cpu(x, *w))
    for r in (0, 5, 36):
        assert np.array_equal(np.asarray(kernel.quant_matmul_cpu(x[r: r + 1], *w))[0], full[r])


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_reads_a_layer_of_stacked_weights_in_place(fmt):
    """The model's layer scan passes whole stacks and a traced layer index (a scan input's slice
    would be copied first): each layer's result is the unstacked call's, bit for bit."""
    if not kernel.available():
        pytest.skip("no C++ compiler")
    rng = np.random.default_rng(9)
    layers = [random_quantized(rng, 40, 96, fmt) for _ in range(3)]
    stack = tuple(None if layers[0][i] is None else jnp.asarray(np.stack([w[i] for w in layers])) for i in range(3))
    x = jnp.asarray(rng.standard_normal((5, 96), dtype=np.float32))

    def scan(x):
        return jax.lax.scan(lambda c, l: (c, kernel.quant_matmul_cpu(x, *stack, layer=l)), 0, jnp.arange(3))[1]

    got = np.asarray(jax.jit(scan)(x))
    for i, w in enumerate(layers):
        assert np.array_equal(got[i], np.asarray(kernel.quant_matmul_cpu(x, *as_jnp(*w))))
    with pytest.raises(ValueError, match="layer index exactly when"):
        kernel.quant_matmul_cpu(x, *stack)
    with pytest.raises(Exception, match="layer index out of range"):
        kernel.quant_matmul_cpu(x, *stack, layer=3).block_until_ready()


@pytest.mark.parametrize("fmt", FORMATS)
def test_xla_path_matches_kernel_and_reference(fmt):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 192), dtype=np.float32)
    w = random_quantized(rng, 70, 192, fmt)
    ref = linear_reference(x, *w)
    y = np.asarray(jax.jit(lambda x: linear(x, *as_jnp(*w), impl="xla"))(x))
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
    bf = linear(jnp.asarray(x, jnp.bfloat16), *as_jnp(*w), impl="xla")
    assert bf.dtype == jnp.bfloat16 and np.abs(np.asarray(bf, np.float32) - ref).max() <= 0.02 * np.abs(ref).max()


def test_in_dims_not_a_multiple_of_the_group_are_clear_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(np.ones((48, 8), np.float32))
    if kernel.available():
        with pytest.raises(ValueError, match="multiple of 32"):
            kernel.quant_matmul_cpu(jnp.ones((1, 48)), jnp.ones((8, 48), jnp.int8), jnp.ones((8, 1)))
        with pytest.raises(ValueError, match="need offsets"):
            kernel.quant_matmul_cpu(jnp.ones((1, 64)), jnp.ones((8, 32), jnp.uint8), jnp.ones((8, 2)))


def test_quantize_round_trip():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((2, 96, 40)).astype(np.float32)
    w[0, :32, 3] = 0.0  # a constant group: scale 0, every value its offset, no NaN
    w[1, 32:64, 5] = 0.7
    w[1, :32, 6] = np.abs(w[1, :32, 6])  # one-sided: affine spends all 256 levels on [min, max]
    q, s, m = quantize(w)
    assert q.dtype == np.int8 and q.shape == (2, 40, 96) and s.shape == m.shape == (2, 40, 3)
    assert s.dtype == m.dtype == np.float32
    back = dequantize(q, s, m)
    assert back.shape == w.shape and np.isfinite(back).all()
    assert (back[0, :32, 3] == 0).all() and np.allclose(back[1, 32:64, 5], 0.7)
    step = np.repeat(np.swapaxes(s, -1, -2), GROUP, axis=-2)  # each element's scale, [.., in, out]
    assert (np.abs(back - w) <= step / 2 + 1e-6).all()
    assert q.min() == -128 and q.max() == 127  # every group's min and max land on the ends
    assert np.array_equal(quantize(back)[0], q)  # quantizing dequantized weights changes nothing


def test_q4_packing_is_ggufs_order():
    values = np.random.default_rng(6).integers(0, 16, (3, 64))
    packed = pack_q4(values)
    assert packed.dtype == np.uint8 and packed.shape == (3, 32)
    assert np.array_equal(unpack_q4(packed), values)
    # Byte i of a group: element i in the low nibble, element i + 16 in the high one.
    assert packed[1, 17] == values[1, 33] | (values[1, 49] << 4)


def test_affine_int8_represents_q4_1_weights_exactly():
    """A Q4_1 block spans 0..15 steps of d: affine int8 puts it on a grid of d/17, so the default
    model's weights (its Q4_1 file) survive --quantization int8 up to float rounding."""
    rng = np.random.default_rng(7)
    d = rng.random((8, 1, 4)).astype(np.float32) * 0.01 + 1e-3
    lo = rng.standard_normal((8, 1, 4)).astype(np.float32) * 0.01
    q4 = rng.integers(0, 16, (8, 32, 4))
    q4[:, 0], q4[:, 1] = 0, 15  # Q4_1 puts a block's min at 0 and its max at 15
    w = (d * q4 + lo).reshape(256, 4)
    q, s, m = quantize(w)
    assert np.abs(dequantize(q, s, m) - w).max() <= 1e-6 * np.abs(w).max()


# --- quantized models against float32 ------------------------------------------------------------

def compare(cfg: ModelConfig, params: dict, prompts: list[list[int]], impl: str = "auto",
            quantized: dict | None = None, method: str = "int8") -> dict:
    """Teacher-forced over each prompt: greedy (argmax) agreement and |log p(next token)| differences
    between the float model and its quantized params (default: quantize_params)."""
    f32 = LlamaForCausalLM.from_arrays(cfg, {k: jnp.asarray(v) for k, v in params.items()})
    quantized = quantize_params(cfg, params) if quantized is None else quantized
    qm = LlamaForCausalLM.from_arrays(cfg, {k: jnp.asarray(v) for k, v in quantized.items()},
                                      quantization=method, quant_impl=impl)
    return dict(teacher_forced_gap(prompts, prefill_logits(f32, prompts), prefill_logits(qm, prompts)),
                impl=qm.quant_impl)


# Tiny random models (initializer_range 0.2, near-tied logits), affine groups: measured agreement
# 0.93-0.99, mean |d log p| 0.021-0.040, max 0.27 over 238 tokens (symmetric groups gave 0.93-0.98,
# 0.027-0.038, 0.24: on ~N(0, 0.2) weights both spend their levels alike). See docs/quantization.md.
@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_tiny_models_close_to_float32(arch, tiny_checkpoints):
    cfg, params = load_weights(tiny_checkpoints[arch], use_cache=False)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, n).tolist() for n in (7, 16, 17, 40, 64, 100)]
    m = compare(cfg, params, prompts)
    print(arch, m)
    assert m["agree"] >= 0.88 and m["dlogp_mean"] <= 0.06 and m["dlogp_max"] <= 0.5, m


def default_model_texts() -> tuple[ModelConfig, dict, list[list[int]]]:
    cfg, params = load_weights(None)
    tok = load_tokenizer(None)
    return cfg, params, [tok(t).input_ids for t in json.loads(TEXTS.read_text())]


# The default model (SmolLM2-135M from its Q4_1 GGUF), 12 texts, 573 scored tokens; measured:
# argmax agreement 0.995 (3 of 573 differ), mean |d log p| 0.014, max 0.10. Both impls alike.
# (The linear layers' Q4_1 blocks survive affine int8 exactly; the differences come from the
# embedding, which the file holds as Q8_0.)
@pytest.mark.parametrize("impl", ["kernel", "xla"])
def test_default_model_close_to_float32(impl):
    if impl == "kernel" and not kernel.available():
        pytest.skip("no C++ compiler")
    m = compare(*default_model_texts(), impl=impl)
    print(m)
    assert m["impl"] == impl and m["tokens"] > 500
    assert m["agree"] >= 0.99 and m["dlogp_mean"] <= 0.03 and m["dlogp_max"] <= 0.3, m


# --- GGUF weights in their own quantization (--quantization gguf) ------------------------------

@pytest.mark.parametrize("impl", ["kernel", "xla"])
def test_default_model_gguf_is_the_float_model(impl):
    """The default file's Q4_1 layers and Q8_0 embedding, never dequantized, compute the model
    that float32 serves (the same weights, summed in another order): measured max |d log p| 3.6e-5."""
    if impl == "kernel" and not kernel.available():
        pytest.skip("no C++ compiler")
    cfg, params, prompts = default_model_texts()
    _, native = load_weights(None, quantization="gguf")
    assert native["wq"].dtype == np.uint8 and native["wq"].shape == (30, 576, 288) and "wq_offset" in native
    assert native["embed"].dtype == np.int8 and "embed_offset" not in native  # Q8_0: scales only
    assert native["wq_scale"].dtype == native["wq_offset"].dtype == native["embed_scale"].dtype == np.float16
    m = compare(cfg, params, prompts, impl=impl, quantized=native, method="gguf")
    print(m)
    assert m["impl"] == impl and m["agree"] == 1.0 and m["dlogp_max"] <= 1e-3, m


@pytest.fixture(scope="module")
def tiny_gguf(tiny_checkpoints, tmp_path_factory):
    from gguf_utils import write_gguf

    root = tmp_path_factory.mktemp("quant_gguf")
    made = {}

    def get(arch: str, quant: str) -> Path:
        if (arch, quant) not in made:
            made[arch, quant] = root / f"{arch}-{quant}.gguf"
            write_gguf(tiny_checkpoints[arch], made[arch, quant], quant)
        return made[arch, quant]

    return get


# llama3: q/k rows interleaved by the converter (undone on the quantized rows); llama_mqa_tied:
# a tied quantized embedding; qwen3: not permuted, separate head.
@pytest.mark.parametrize("arch", ["llama3", "llama_mqa_tied", "qwen3"])
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_are_the_files_values(arch, quant, tiny_gguf):
    """Served natively, every weight is what the gguf package dequantizes from the file."""
    path = tiny_gguf(arch, quant)
    cfg, native = load_weights(path, quantization="gguf")
    _, flt = load_weights(path, use_cache=False)
    packed = quant != "Q8_0"
    for name in ("wq", "wk", "wo", "w_down"):
        assert native[name].dtype == (np.uint8 if packed else np.int8)
        assert (name + "_offset" in native) == packed
    back = dequantize_params(native)
    assert set(back) == set(flt)
    for name, value in flt.items():
        assert np.allclose(back[name], value, rtol=0, atol=1e-6 * np.abs(value).max()), name
    prompts = [[1, 54, 198, 214, 72, 30], list(range(5, 45))]
    m = compare(cfg, flt, prompts, quantized=native, method="gguf")
    assert m["agree"] == 1.0 and m["dlogp_max"] <= 1e-4, m


def test_gguf_q4_k_blocks_are_the_files_values():
    """Q4_K (the gguf package cannot write it): random super-blocks, every byte pattern of the
    6-bit scales and the nibbles, against the package's own dequantization."""
    from types import SimpleNamespace

    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    from jaxserve.loading.gguf_checkpoint import native_blocks

    out, n_in = 6, 768
    raw = np.random.default_rng(8).integers(0, 256, (out, n_in // 256, 144), dtype=np.uint8)
    raw[..., 0:2] = np.frombuffer(np.float16(0.013).tobytes(), np.uint8)  # d and dmin: finite f16
    raw[..., 2:4] = np.frombuffer(np.float16(-0.007).tobytes(), np.uint8)
    t = SimpleNamespace(name="blk.0.ffn_down.weight", data=raw.reshape(out, -1), shape=[n_in, out],
                        tensor_type=GGMLQuantizationType.Q4_K)
    q, s, m = native_blocks(t)
    assert q.dtype == np.uint8 and q.shape == (out, n_in // 2) and s.shape == m.shape == (out, n_in // GROUP)
    ref = gguf_dequantize(t.data, GGMLQuantizationType.Q4_K).reshape(out, n_in)
    assert np.array_equal(dequantize(q, s, m).T, ref)


def test_engine_serves_a_gguf_in_its_quantization(tiny_gguf, caplog):
    path = tiny_gguf("llama3", "Q4_1")
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.engine"):
        llm = LLM(model=str(path), quantization="gguf", **small_engine_options(max_num_seqs=3))
    assert "quantization gguf: 4-bit + offsets" in caplog.text
    assert llm.engine.runner.model.wq[...].dtype == jnp.uint8
    flt = LLM(model=str(path), **small_engine_options(max_num_seqs=3))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params, use_tqdm=False)]
    assert ours == [o.outputs[0].token_ids for o in flt.generate(PROMPTS[:4], params, use_tqdm=False)]
    # Sampled as clients send by default (temperature 1.0), seeded, n=2: the same weights give
    # the float model's draws (logits differ by ~1e-5, summation order).
    sampled = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, n=2, ignore_eos=True)
    draws = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[:4], sampled, use_tqdm=False)]
    assert draws == [[c.token_ids for c in o.outputs] for o in flt.generate(PROMPTS[:4], sampled, use_tqdm=False)]
    assert any(d[0] != d[1] for d in draws)  # the two samples of a prompt are not greedy copies
    assert llm.engine.weight_bytes < 0.3 * flt.engine.weight_bytes


def test_gguf_quantization_needs_a_gguf_file(tiny_checkpoints):
    with pytest.raises(ValueError, match="--quantization gguf serves a .gguf file"):
        load_weights(tiny_checkpoints["qwen3"], quantization="gguf")


# --- the engine ----------------------------------------------------------------------------------

PROMPTS = [[1, 54, 198, 214, 72, 30], list(range(5, 45)), [17, 3, 99], list(range(100, 119)), [7] * 30,
           list(range(200, 250)), [9, 8, 7, 6], list(range(60, 90))]


def test_engine_greedy_is_the_same_alone_or_batched(tiny_checkpoints, caplog):
    """Continuous batching over 3 slots (requests join and leave mid-flight) gives every request
    the tokens it gets alone, and the engine runs the quantized model (the kernel on CPU)."""
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.engine"):
        llm = LLM(model=str(tiny_checkpoints["llama3"]), quantization="int8",
                  **small_engine_options(max_num_seqs=3, max_num_batched_tokens=32))
    assert "quantization int8" in caplog.text and "MiB" in caplog.text
    model = llm.engine.runner.model
    assert model.quantization == "int8" and model.wq[...].dtype == jnp.int8
    assert model.quant_impl == ("kernel" if kernel.available() else "xla")
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(len(PROMPTS))]
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    alone = [llm.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(PROMPTS, params)]
    assert batched == alone
    assert [len(t) for t in batched] == [sp.max_tokens for sp in params]
    # Against the quantized model run directly (no engine): the first greedy token of each prompt.
    logits = prefill_logits(model, PROMPTS)
    assert [int(lg[-1].argmax()) for lg in logits] == [t[0] for t in batched]


def test_engine_int8_weight_bytes_and_cache(tiny_checkpoints, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path))
    path = tiny_checkpoints["qwen3"]
    cfg, first = load_weights(path, quantization="int8")
    with caplog.at_level(logging.INFO, logger="jaxserve.loading"):
        _, again = load_weights(path, quantization="int8")
    assert "restoring int8-quantized weights" in caplog.text
    assert set(first) == set(again) and all(np.array_equal(first[k], again[k]) for k in first)
    assert {k for k in first if k.endswith("_scale")} == {n + "_scale" for n in quantized_names(cfg)}
    assert {k for k in first if k.endswith("_offset")} == {n + "_offset" for n in quantized_names(cfg)}
    f32 = LLM(model=str(path), **small_engine_options())
    q8 = LLM(model=str(path), quantization="int8", **small_engine_options())
    assert q8.engine.weight_bytes < 0.45 * f32.engine.weight_bytes


def test_bfloat16_int8_runs(tiny_checkpoints):
    llm = LLM(model=str(tiny_checkpoints["qwen2"]), quantization="int8", dtype="bfloat16", **small_engine_options())
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


_MESH_WORKER = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
from jaxserve import LLM, SamplingParams
prompts = json.loads(sys.argv[2])
res = {}
for mesh in ("1x1", "1x2"):
    llm = LLM(model=sys.argv[1], mesh=mesh, quantization="int8", max_num_seqs=4, max_num_batched_tokens=32,
              num_pages=48, max_model_len=128, compile_ahead=False, compilation_cache_dir=None, show_progress=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1),
                        use_tqdm=False)
    res[mesh] = dict(impl=llm.engine.runner.model.quant_impl,
                     tokens=[o.outputs[0].token_ids for o in outs],
                     lps=[[getattr(v, "logprob", v) for d in o.outputs[0].logprobs for v in list(d.values())[:1]] for o in outs],
                     scale_spec=str(llm.engine.runner.model.wo_scale[...].sharding.spec))
print("RESULT" + json.dumps(res))
"""


def test_mesh_1x2_matches_1x1(tiny_checkpoints):
    """1x1 runs the CPU kernel, 1x2 XLA's dot with the scales split like their weights."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _MESH_WORKER, str(tiny_checkpoints["qwen3"]), json.dumps(PROMPTS[:4])],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    one, two = res["1x1"], res["1x2"]
    assert two["impl"] == "xla" and "model" in two["scale_spec"]
    assert one["tokens"] == two["tokens"]
    assert np.allclose(np.concatenate(one["lps"]), np.concatenate(two["lps"]), atol=1e-3)


# --- configuration -------------------------------------------------------------------------------

def test_config_flag_and_yaml(tmp_path):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert config_from_args(p.parse_args(["--quantization", "int8"])).quantization == "int8"
    assert config_from_args(p.parse_args(["--quantization", "none"])).quantization == "none"
    assert config_from_args(p.parse_args(["--quantization", "gguf"])).quantization == "gguf"
    assert config_from_args(p.parse_args([])).quantization == "none"
    with pytest.raises(SystemExit):
        p.parse_args(["--quantization", "int4"])
    yaml_file = tmp_path / "q.yaml"
    yaml_file.write_text("quantization: int8\nmax_num_seqs: 4\n")
    assert EngineConfig.from_yaml(yaml_file).quantization == "int8"
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="fp8")


def test_moe_models_are_refused():
    cfg = ModelConfig("Qwen3MoeForCausalLM", 256, 64, 128, 2, 4, 2, 16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        quantized_names(cfg)
