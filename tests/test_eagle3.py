"""Speculative decoding with an EAGLE-3 head (method "eagle3"): the head's forward pass against a
torch reference written from the published architecture, the target's feature streams against
transformers' hidden states, and the engine: outputs identical to decoding without speculation
(greedy, seeded sampling, stops, preemption, prefix cache), a head that predicts the target
exactly accepted every time, nothing compiled after warm-up.

No trained head can be fetched here (no hub): heads are random, in the published checkpoint format
(config.json + safetensors with `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import small_engine_options
from server_utils import make_full_vocab_tiny
from test_speculative import PROMPTS, mixed_params, same_outputs_but_tail_flips

from jaxserve import LLM, SamplingParams

E, LAYERS, DRAFT_VOCAB = 64, 4, 2048


def make_head(root: Path, name: str, vocab: int, seed: int = 0, draft_vocab: int = DRAFT_VOCAB,
              predict_token: int | None = None, aux_ids: list[int] | None = None) -> Path:
    """A random EAGLE-3 head in the published format for a target of hidden size E. Draft id d is
    target token 3d (d2t[d] = 2d). predict_token: a head whose every draft is that token (a zero
    LM head: draft id 0, mapped to it)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    H, KVH, D, F = 4, 2, 16, 128
    r = lambda *shape, s=0.1: torch.randn(*shape, generator=g) * s  # noqa: E731
    w = {"fc.weight": r(E, 3 * E), "midlayer.input_layernorm.weight": 1 + r(E),
         "midlayer.hidden_norm.weight": 1 + r(E), "midlayer.post_attention_layernorm.weight": 1 + r(E),
         "midlayer.self_attn.q_proj.weight": r(H * D, 2 * E), "midlayer.self_attn.k_proj.weight": r(KVH * D, 2 * E),
         "midlayer.self_attn.v_proj.weight": r(KVH * D, 2 * E), "midlayer.self_attn.o_proj.weight": r(E, H * D),
         "midlayer.mlp.gate_proj.weight": r(F, E), "midlayer.mlp.up_proj.weight": r(F, E),
         "midlayer.mlp.down_proj.weight": r(E, F), "norm.weight": 1 + r(E), "lm_head.weight": r(draft_vocab, E, s=1.0),
         "d2t": torch.arange(draft_vocab) * 2, "t2d": torch.zeros(vocab, dtype=torch.bool)}
    if predict_token is not None:
        w["lm_head.weight"] = torch.zeros(draft_vocab, E)
        w["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
        w["d2t"][0] = predict_token
    config = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": E, "intermediate_size": F,
              "num_attention_heads": H, "num_key_value_heads": KVH, "num_hidden_layers": 1, "vocab_size": vocab,
              "draft_vocab_size": draft_vocab, "target_hidden_size": E, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "max_position_embeddings": 512, "hidden_act": "silu"}
    if aux_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids}
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    target = make_full_vocab_tiny(root, num_hidden_layers=LAYERS, tie_word_embeddings=False)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    return dict(target=target, vocab=vocab, head=make_head(root, "head", vocab))


def spec(head: Path, k: int = 3) -> str:
    return json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": k})


# ---- the pieces ---------------------------------------------------------------------------------

def torch_head_reference(path: Path, embed: np.ndarray, tokens: list[int], hidden: np.ndarray):
    """The head over one sequence from position 0 (position p: token p + 1 and hidden p), written
    from the architecture with torch: (greedy target ids, prenorm states)."""
    import torch
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text())
    w = load_file(str(path / "model.safetensors"))
    H, KVH = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg["hidden_size"] // H
    T = len(tokens)

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]) * weight

    def rope(x):  # [T, heads, D], HF rotate-half
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]
        cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None].float(), torch.cat([ang.sin(), ang.sin()], -1)[:, None].float()
        rot = torch.cat([-x[..., D // 2:], x[..., : D // 2]], -1)
        return x * cos + rot * sin

    h_in = torch.tensor(hidden)
    e = norm(torch.tensor(embed)[torch.tensor(tokens)], w["midlayer.input_layernorm.weight"])
    h = norm(h_in, w["midlayer.hidden_norm.weight"])
    x = torch.cat([e, h], -1)
    q = rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(T, H, D))
    k = rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(T, KVH, D))
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(T, KVH, D)
    k, v = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / D ** 0.5
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, H * D)
    x = attn @ w["midlayer.self_attn.o_proj.weight"].T + h_in
    m = norm(x, w["midlayer.post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T))
    prenorm = mlp @ w["midlayer.mlp.down_proj.weight"].T + x
    logits = norm(prenorm, w["norm.weight"]) @ w["lm_head.weight"].T
    draft = logits.argmax(-1)
    return (draft + w["d2t"][draft]).numpy(), prenorm.numpy()


def test_head_forward_matches_a_torch_reference(models):
    import jax.numpy as jnp

    from jaxserve.attention import AttentionMetadata, get_attention_fn
    from jaxserve.models.eagle3 import Eagle3Head, load_eagle3

    cfg, params, d2t = load_eagle3(models["head"])
    rng = np.random.default_rng(0)
    embed = rng.normal(size=(cfg.vocab_size, E)).astype(np.float32)
    head = Eagle3Head(cfg, {**params, "embed": embed}, d2t)
    T, page = 12, 4
    tokens = rng.integers(0, cfg.vocab_size, T).tolist()
    aux = rng.normal(size=(T, 3 * E)).astype(np.float32)
    hidden = np.asarray(head.combine(jnp.asarray(aux)))
    np.testing.assert_allclose(hidden, aux @ params["fc"], rtol=1e-5, atol=1e-5)
    pages = np.arange(1, 1 + T // page, dtype=np.int32)  # page 0: the null page
    md = AttentionMetadata(positions=jnp.arange(T, dtype=jnp.int32),
                           slot_mapping=jnp.asarray(pages[np.arange(T) // page] * page + np.arange(T) % page),
                           kv_lens=jnp.asarray([T], jnp.int32), page_tables=jnp.asarray(pages[None]),
                           cu_q_lens=jnp.asarray([0, T], jnp.int32), num_seqs=jnp.asarray([1], jnp.int32))
    kv = jnp.zeros((1 + T // page, page, 2 * cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    prenorm, _ = head(jnp.asarray(tokens, jnp.int32), jnp.asarray(hidden), md, kv, get_attention_fn("xla"))
    draft = head.draft_ids(prenorm)
    ref_draft, ref_prenorm = torch_head_reference(models["head"], embed, tokens, hidden)
    np.testing.assert_allclose(np.asarray(prenorm), ref_prenorm, rtol=1e-4, atol=1e-4)
    assert np.asarray(draft).tolist() == ref_draft.tolist()
    assert all(t % 3 == 0 for t in ref_draft)  # d2t[d] = 2d: draft id d is target token 3d


def test_target_streams_are_the_inputs_of_the_chosen_layers(models):
    """ModelRunner aux streams = transformers' hidden_states[i] (the stream entering layer i)."""
    import jax.numpy as jnp
    import torch
    import transformers

    from jaxserve.attention import AttentionMetadata, get_attention_fn
    from jaxserve.loading import load_weights
    from jaxserve.models.llama import LlamaForCausalLM

    cfg, params = load_weights(models["target"], "float32", use_cache=False)
    model = LlamaForCausalLM(cfg)
    model.load_params(params)
    ids = [1, 5, 9, 200, 3000, 7, 11]
    T, page = len(ids), 8
    md = AttentionMetadata(positions=jnp.arange(T, dtype=jnp.int32), slot_mapping=jnp.arange(T, dtype=jnp.int32) + page,
                           kv_lens=jnp.asarray([T], jnp.int32), page_tables=jnp.asarray([[1]], jnp.int32),
                           cu_q_lens=jnp.asarray([0, T], jnp.int32), num_seqs=jnp.asarray([1], jnp.int32))
    kv = jnp.zeros((cfg.num_layers, 2, page, 2 * cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    _, _, aux = model(jnp.asarray(ids, jnp.int32), md, kv, get_attention_fn("xla"), aux_layers=(2, 0, 3))
    hf = transformers.AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32)
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = np.concatenate([states[i][0].numpy() for i in (2, 0, 3)], -1)
    np.testing.assert_allclose(np.asarray(aux), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(architectures=["LlamaForCausalLM"]), "not an EAGLE-3 head"),
    (lambda c: c.update(num_hidden_layers=2), "one layer"),
    (lambda c: c.update(draft_vocab_size=100), "lm_head"),
])
def test_bad_head_checkpoints_are_refused(models, tmp_path, change, message):
    import shutil

    from jaxserve.models.eagle3 import load_eagle3

    path = tmp_path / "head"
    shutil.copytree(models["head"], path)
    cfg = json.loads((path / "config.json").read_text())
    change(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        load_eagle3(path)


def test_a_head_for_another_target_is_refused(models, tmp_path):
    head = make_head(tmp_path, "small-vocab", vocab=1000, draft_vocab=300)
    with pytest.raises(ValueError, match="vocabulary of 1000"):
        LLM(**small_engine_options(model=str(models["target"]), speculative_config=spec(head)))
    with pytest.raises(ValueError, match="'model'"):
        LLM(**small_engine_options(model=str(models["target"]),
                                   speculative_config=json.dumps({"method": "eagle3", "num_speculative_tokens": 2})))


# ---- the engine ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(models):
    return LLM(**small_engine_options(model=str(models["target"]), async_scheduling=False))


@pytest.mark.parametrize("options", [{}, dict(max_num_batched_tokens=16, max_num_seqs=4),
                                     dict(num_pages=20, enable_prefix_caching=True)])
def test_eagle3_gives_the_tokens_of_plain_decoding(models, reference, options):
    """Greedy, seeded sampled, penalties, stops, n=2 (mixed_params) with a random head: the same
    outputs as without speculation; chunked prefill with few spare rows; a pool small enough to
    preempt, with the prefix cache."""
    ref = reference if not options else LLM(**small_engine_options(model=str(models["target"]),
                                                                    async_scheduling=False, **options))
    # 16 sampler rows for 9 sequences (unless the options say otherwise): drafts take only rows that
    # neither a running nor a waiting request needs.
    llm = LLM(**small_engine_options(model=str(models["target"]), speculative_config=spec(models["head"]),
                                     **{"max_num_seqs": 16, **options}))
    params = mixed_params()
    a = llm.generate(PROMPTS, params, use_tqdm=False)
    b = ref.generate(PROMPTS, params, use_tqdm=False)
    assert same_outputs_but_tail_flips(a, b, params) <= 1
    stats = llm.engine.spec_decode_stats
    few_rows = options.get("max_num_seqs") == 4  # drafts only once the last sequences run alone
    assert stats.num_drafts > (3 if few_rows else 10) and stats.acceptance_rate < 0.5, stats  # random head: drafts mostly fail
    assert llm.engine.replicas[0].drafter.num_draft_steps > 0
    assert not llm.engine.has_unfinished()
    llm.engine.check_invariants()


def test_a_head_that_predicts_the_target_is_always_accepted(models, tmp_path):
    """A target whose greedy output is always token 0 (zero final norm) and a head that always
    drafts token 0: every draft accepted, k + 1 tokens a verified step; nothing compiles after
    warm-up, aborts leave the pool consistent."""
    import shutil

    target = tmp_path / "constant"
    shutil.copytree(models["target"], target)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(target / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 0
    save_file(weights, str(target / "model.safetensors"))
    head = make_head(tmp_path, "exact", models["vocab"], predict_token=0)
    llm = LLM(**small_engine_options(model=str(target), speculative_config=spec(head, k=3), compile_ahead=True))
    greedy = SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS[:4], greedy, use_tqdm=False)
    assert all(o.outputs[0].token_ids == [0] * 33 for o in outs)
    stats = llm.engine.spec_decode_stats
    assert stats.acceptance_rate > 0.97 and stats.mean_accepted_length > 3.0, stats
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", prompt, greedy)
    for _ in range(3):
        engine.step()
    for i in range(3):
        engine.abort(f"r{i}")
    while engine.has_unfinished():
        engine.step()
    engine.check_invariants()
    assert engine.compiles_after_warmup == 0


MESH_SCRIPT = """
import os, json, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, {tests!r})
from conftest import small_engine_options
from test_speculative import PROMPTS
from jaxserve import LLM, SamplingParams
spec = json.dumps({{"method": "eagle3", "model": {head!r}, "num_speculative_tokens": 3}})
params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
out = {{}}
for mesh, config in (("1x1", None), ("1x1 eagle3", spec), ("2x2", spec), ("1x2", spec)):
    llm = LLM(**small_engine_options(model={target!r}, mesh=mesh.split()[0], speculative_config=config))
    out[mesh] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    llm.engine.check_invariants()
    out[mesh + " drafted"] = llm.engine.spec_decode_stats.num_draft_tokens
    out[mesh + " accepted"] = llm.engine.spec_decode_stats.num_accepted_tokens
print(json.dumps(out))
"""


@pytest.mark.slow
def test_eagle3_on_meshes_matches_1x1(models):
    """The head replicated on each replica's devices (2x2: two replicas of 2-way tensor
    parallelism; 1x2): the greedy tokens of a 1x1 engine without speculation, and the same drafts
    as the 1x1 head's (its acceptance counts equal)."""
    import subprocess
    import sys

    from test_parallel import worker_env

    code = MESH_SCRIPT.format(tests=str(Path(__file__).parent), target=str(models["target"]), head=str(models["head"]))
    proc = subprocess.run([sys.executable, "-c", code], env=worker_env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["1x1 eagle3"] == out["2x2"] == out["1x2"] == out["1x1"]
    assert out["1x1 eagle3 drafted"] > 20
    assert out["1x2 accepted"] == out["1x1 eagle3 accepted"] and out["1x2 drafted"] == out["1x1 eagle3 drafted"]


@pytest.mark.parametrize("arch", ["llama3", "llama_mqa_tied", "mistral_swa", "qwen2", "qwen3", "gemma3"])
def test_eagle3_on_each_architecture_gives_plain_greedy_tokens(tiny_checkpoints, tmp_path, arch):
    """A random head (reading target layers 0, 1, 1) on every tiny architecture: the target's
    greedy tokens, with drafts proposed and verified."""
    target = tiny_checkpoints[arch]
    head = make_head(tmp_path, "head", vocab=256, draft_vocab=80, aux_ids=[0, 1, 1])
    prompts = [[1, 17, 42, 99, 7], [1, 200, 3, 3, 3, 3, 250], [1, 5]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = LLM(**small_engine_options(model=str(target), async_scheduling=False)).generate(prompts, params,
                                                                                           use_tqdm=False)
    llm = LLM(**small_engine_options(model=str(target), speculative_config=spec(head)))
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.spec_decode_stats.num_draft_tokens > 0
    llm.engine.check_invariants()


def test_eagle3_on_an_int8_target_gives_its_greedy_tokens(models, tmp_path):
    """A quantized target with tied embeddings (int8 linears, and the embedding quantized as the LM
    head): the head reads the target's embedding dequantized once; the tokens are the quantized
    target's own."""
    target = make_full_vocab_tiny(tmp_path, num_hidden_layers=LAYERS)  # (tied: the embedding is quantized)
    opts = dict(model=str(target), quantization="int8")
    prompts = PROMPTS[:3]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = LLM(**small_engine_options(async_scheduling=False, **opts)).generate(prompts, params, use_tqdm=False)
    llm = LLM(**small_engine_options(speculative_config=spec(models["head"]), **opts))
    assert "embed_scale" in llm.engine.replicas[0].runner.model.param_names
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.spec_decode_stats.num_draft_tokens > 0
