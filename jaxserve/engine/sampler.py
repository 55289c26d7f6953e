"""On-device sampling for a whole batch, each row with its own parameters.

Only sampled ids and the top-n logprobs leave the device. Randomness is keyed per request by
(seed, index of the token in the output), so a seeded request samples the same tokens whatever
the batch around it, and a request resumed after preemption continues identically.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sampling_params import MAX_LOGPROBS

MAX_BANNED = 32  # ids masked while a request is below min_tokens (EOS + stop ids)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling inputs, padded to the sequence bucket S. History is [S, H] token ids
    (prompt then output, -1 padded) and is filled only for rows that use penalties."""

    temperature: jax.Array  # [S] f32; 0 = greedy
    top_k: jax.Array  # [S] i32; <= 0 = off
    top_p: jax.Array  # [S] f32
    min_p: jax.Array  # [S] f32
    repetition_penalty: jax.Array  # [S] f32
    presence_penalty: jax.Array  # [S] f32
    frequency_penalty: jax.Array  # [S] f32
    seeds: jax.Array  # [S] u32
    steps: jax.Array  # [S] i32: index of the token being sampled in the output
    history: jax.Array  # [S, H] i32
    prompt_lens: jax.Array  # [S] i32
    banned: jax.Array  # [S, MAX_BANNED] i32, -1 padded
    want_logprobs: jax.Array  # [S] bool


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SampleOutput:
    token_ids: jax.Array  # [S] i32
    logprobs: jax.Array  # [S] f32 logprob of the sampled token
    top_ids: jax.Array  # [S, MAX_LOGPROBS] i32
    top_logprobs: jax.Array  # [S, MAX_LOGPROBS] f32


def empty_sampling_arrays(num_rows: int, history_len: int) -> dict[str, np.ndarray]:
    """Host-side buffers with neutral values, to be filled row by row."""
    return dict(
        temperature=np.zeros(num_rows, np.float32),
        top_k=np.zeros(num_rows, np.int32),
        top_p=np.ones(num_rows, np.float32),
        min_p=np.zeros(num_rows, np.float32),
        repetition_penalty=np.ones(num_rows, np.float32),
        presence_penalty=np.zeros(num_rows, np.float32),
        frequency_penalty=np.zeros(num_rows, np.float32),
        seeds=np.zeros(num_rows, np.uint32),
        steps=np.zeros(num_rows, np.int32),
        history=np.full((num_rows, history_len), -1, np.int32),
        prompt_lens=np.zeros(num_rows, np.int32),
        banned=np.full((num_rows, MAX_BANNED), -1, np.int32),
        want_logprobs=np.zeros(num_rows, np.bool_),
    )


def _apply_penalties(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    rows, vocab = logits.shape
    hist = s.history
    valid = hist >= 0
    is_output = jnp.arange(hist.shape[1])[None, :] >= s.prompt_lens[:, None]
    row_idx = jnp.broadcast_to(jnp.arange(rows)[:, None], hist.shape)
    tok = jnp.where(valid, hist, 0)
    seen = jnp.zeros((rows, vocab), jnp.bool_).at[row_idx, tok].max(valid)
    out_counts = jnp.zeros((rows, vocab), jnp.float32).at[row_idx, tok].add((valid & is_output).astype(jnp.float32))
    rp = s.repetition_penalty[:, None]
    # HF/vLLM convention: divide positive logits, multiply negative ones, for every seen token.
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - s.frequency_penalty[:, None] * out_counts
    return logits - s.presence_penalty[:, None] * (out_counts > 0)


def _sample_stochastic(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    rows, vocab = logits.shape
    scaled = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(s.top_k > 0, s.top_k, vocab)[:, None]
    sorted_logits = jnp.where(rank < k, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # top-p keeps the smallest prefix whose mass reaches p (the first token always stays).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < s.top_p[:, None]) & (probs >= s.min_p[:, None] * probs[:, :1])
    sorted_logits = jnp.where(keep | (rank == 0), sorted_logits, -jnp.inf)

    def row_key(seed, step):
        return jax.random.fold_in(jax.random.key(seed), step)

    keys = jax.vmap(row_key)(s.seeds, s.steps)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(keys)
    choice = jnp.argmax(sorted_logits + gumbel, axis=-1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def sample(logits: jax.Array, s: SamplingArrays) -> SampleOutput:
    """logits [S, V] float32 -> sampled ids and logprobs (of the raw model distribution)."""
    rows, vocab = logits.shape
    raw_logits = logits
    any_penalty = jnp.any((s.repetition_penalty != 1.0) | (s.presence_penalty != 0) | (s.frequency_penalty != 0))
    logits = jax.lax.cond(any_penalty, _apply_penalties, lambda l, _: l, logits, s)
    banned_valid = s.banned >= 0
    row_idx = jnp.broadcast_to(jnp.arange(rows)[:, None], s.banned.shape)
    ban = jnp.zeros((rows, vocab), jnp.bool_).at[row_idx, jnp.where(banned_valid, s.banned, 0)].max(banned_valid)
    logits = jnp.where(ban, -jnp.inf, logits)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    all_greedy = jnp.all(s.temperature == 0.0)
    sampled = jax.lax.cond(all_greedy, lambda l, _: greedy, _sample_stochastic, logits, s)
    tokens = jnp.where(s.temperature == 0.0, greedy, sampled)

    def logprobs(l, toks):
        lp = jax.nn.log_softmax(l, axis=-1)
        top_lp, top_ids = jax.lax.top_k(lp, MAX_LOGPROBS)
        return jnp.take_along_axis(lp, toks[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp

    def no_logprobs(l, toks):  # a full-vocabulary softmax and top-k cost a third of a small step
        return (jnp.zeros(rows, jnp.float32), jnp.zeros((rows, MAX_LOGPROBS), jnp.int32),
                jnp.zeros((rows, MAX_LOGPROBS), jnp.float32))

    token_lp, top_ids, top_lp = jax.lax.cond(jnp.any(s.want_logprobs), logprobs, no_logprobs, raw_logits, tokens)
    return SampleOutput(tokens, token_lp, top_ids, top_lp)
