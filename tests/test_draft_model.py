"""Speculative decoding with a draft model (method "draft_model"): drafts from a second checkpoint
run on its own runner and page pool. The target's own checkpoint as the draft is accepted almost
always; an unrelated random draft almost never; either way the outputs are those of decoding
without speculation (greedy, seeded sampling, logprobs, stops), the draft pool is empty once
every request has finished or been aborted, and nothing compiles after warm-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import small_engine_options
from server_utils import make_full_vocab_tiny
from test_speculative import PROMPTS, mixed_params, same_outputs_but_tail_flips

from jaxserve import LLM, SamplingParams


def _other_random_model(root: Path) -> Path:
    """A random Llama with the same vocabulary as the tiny target but other weights (1 layer), and
    an LM head of its own: a random model with tied embeddings mostly repeats its input token, as
    the tiny target does, and would agree with it."""
    return make_full_vocab_tiny(root, "other-draft", seed=1, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                tie_word_embeddings=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("draft")
    return make_full_vocab_tiny(root), _other_random_model(root)


def _spec(draft: Path, k: int = 4) -> str:
    return json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": k})


def _options(target: Path, **kw) -> dict:
    return small_engine_options(model=str(target), **kw)


@pytest.fixture(scope="module")
def reference(models):
    return LLM(**_options(models[0], async_scheduling=False))


@pytest.mark.parametrize("which, options", [
    ("self", {}),
    ("other", {}),
    ("self", dict(max_num_batched_tokens=16, max_num_seqs=4)),  # draft catch-up in chunks; few spare rows
])
def test_draft_model_gives_the_tokens_of_plain_decoding(models, reference, which, options):
    target, other = models
    draft = target if which == "self" else other
    ref = reference if not options else LLM(**_options(target, async_scheduling=False, **options))
    # 16 sampler rows for 9 sequences (unless the options say otherwise): drafts take only rows that
    # neither a running nor a waiting request needs.
    spec = LLM(**_options(target, speculative_config=_spec(draft), **{"max_num_seqs": 16, **options}))
    params = mixed_params()
    a = spec.generate(PROMPTS, params, use_tqdm=False)
    b = ref.generate(PROMPTS, params, use_tqdm=False)
    assert same_outputs_but_tail_flips(a, b, params) <= 1
    stats = spec.engine.spec_decode_stats
    few_rows = options.get("max_num_seqs") == 4  # drafts only once the last sequences run alone
    assert stats.num_drafts > (3 if few_rows else 10), stats
    if few_rows:
        pass  # which rows draft (the last to finish, greedy or sampled) decides the rate: no bound
    elif which == "self":
        # The target drafting for itself: greedy rows accept every draft (see the test below);
        # sampled rows accept a draft only when the draw equals the target's argmax, rarely on a
        # random model at temperature 1 (and then their drafts pause).
        assert stats.acceptance_rate > 0.4, stats
    else:
        assert stats.acceptance_rate < 0.2, stats
    drafter = spec.engine.replicas[0].drafter
    assert drafter.num_draft_steps > 0
    assert not spec.engine.has_unfinished()
    spec.engine.check_invariants()
    assert drafter.num_cached_requests == 0 and drafter.pool.num_free == drafter.pool.num_pages - 1


def test_greedy_self_drafts_are_all_accepted(models):
    """Greedy requests with the target as its own draft: every draft accepted but at a max_tokens
    or EOS cut (ignore_eos here), so each verified step gains k + 1 tokens."""
    target, _ = models
    spec = LLM(**_options(target, speculative_config=_spec(target, k=3)))
    outs = spec.generate(PROMPTS[:4], SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)
    stats = spec.engine.spec_decode_stats
    assert stats.acceptance_rate > 0.97, stats
    ref = LLM(**_options(target, async_scheduling=False))
    want = ref.generate(PROMPTS[:4], SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]


def test_abort_frees_draft_pages_and_no_compile_after_warmup(models):
    target, other = models
    spec = LLM(**_options(target, speculative_config=_spec(other, k=2), compile_ahead=True))
    engine = spec.engine
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    for _ in range(6):
        engine.step()
    drafter = engine.replicas[0].drafter
    assert drafter.num_cached_requests > 0
    for i in range(4):
        engine.abort(f"r{i}")
    while engine.has_unfinished():
        engine.step()
    engine.check_invariants()
    assert drafter.num_cached_requests == 0 and drafter.pool.num_free == drafter.pool.num_pages - 1
    assert engine.compiles_after_warmup == 0


@pytest.mark.parametrize("bad, message", [
    ({"method": "draft_model", "num_speculative_tokens": 3}, "'model'"),
    ({"method": "ngram", "num_speculative_tokens": 3, "model": "x"}, "'model'"),
])
def test_draft_model_config_errors(bad, message):
    from jaxserve.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=json.dumps(bad))


def test_a_draft_with_another_vocabulary_is_refused(models, tiny_checkpoints):
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(**_options(models[0], speculative_config=_spec(tiny_checkpoints["llama3"])))


def test_per_request_draft_cap(models):
    """num_speculative_tokens on a request: 0 turns its drafts off, k caps them at k a step; the
    tokens are the same either way."""
    target, _ = models
    spec = LLM(**_options(target, speculative_config=_spec(target, k=4)))
    greedy = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
    off = spec.generate(PROMPTS[:2], SamplingParams(num_speculative_tokens=0, **greedy), use_tqdm=False)
    assert spec.engine.spec_decode_stats.num_drafts == 0
    one = spec.generate(PROMPTS[:2], SamplingParams(num_speculative_tokens=1, **greedy), use_tqdm=False)
    stats = spec.engine.spec_decode_stats
    assert stats.num_drafts > 0 and len(stats.accepted_per_pos) == 1, stats
    assert [o.outputs[0].token_ids for o in off] == [o.outputs[0].token_ids for o in one]
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=-1)


MESH_SCRIPT = """
import os, json, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, {tests!r})
from conftest import small_engine_options
from test_speculative import PROMPTS
from jaxserve import LLM, SamplingParams
target = {target!r}
spec = json.dumps({{"method": "draft_model", "model": target, "num_speculative_tokens": 3}})
params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
out = {{}}
for mesh, config in (("1x1", None), ("2x2", spec), ("1x2", spec)):
    llm = LLM(**small_engine_options(model=target, mesh=mesh, speculative_config=config))
    out[mesh] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    llm.engine.check_invariants()
    out[mesh + " accepted"] = llm.engine.spec_decode_stats.num_accepted_tokens
print(json.dumps(out))
"""


@pytest.mark.slow
def test_draft_model_on_meshes_matches_1x1(models):
    """The draft model placed on each replica's devices (2x2) and split over tensor parallelism
    like the target (1x2): the greedy tokens of a 1x1 engine without speculation."""
    import subprocess
    import sys

    from test_parallel import worker_env

    code = MESH_SCRIPT.format(tests=str(Path(__file__).parent), target=str(models[0]))
    proc = subprocess.run([sys.executable, "-c", code], env=worker_env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["2x2"] == out["1x1"] and out["1x2"] == out["1x1"]
    assert out["2x2 accepted"] > 50 and out["1x2 accepted"] > 50
