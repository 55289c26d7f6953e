"""On-device sampling for a whole batch, each row with its own parameters.

Only sampled ids and the top-n logprobs leave the device. Randomness is keyed per request by
(seed, index of the token in the output), so a seeded request samples the same tokens whatever
the batch around it, and a request resumed after preemption continues identically.

Penalties read per-request state kept on the device between steps (`PenaltyState`): the engine
sends a request's token history once, when it starts sampling, not every step. `sample` is the
stateless form (penalties from the history array alone), the reference the tests use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS

MAX_BANNED = 32  # ids masked while a request is below min_tokens (EOS + stop ids)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling inputs, padded to the sequence bucket S. History is [S, H] token ids
    (prompt then output, -1 padded), filled only for rows whose penalty state is (re)built this
    step (`penalty_init`); `sample` (stateless) reads it for every row that uses penalties."""

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
    # Overlapped scheduling: a row whose last input token was still being sampled by the previous
    # step when this one was prepared has it at history[row, pending_col]; pending_src is its index
    # in that step's sampled ids (-1: none pending). Filled on device from those ids.
    pending_src: jax.Array  # [S] i32
    pending_col: jax.Array  # [S] i32
    # The row's slot in the PenaltyState (-1: the row samples without penalties), and whether
    # the slot is rebuilt from this row's history first (the request's first sampling step since
    # it got the slot).
    penalty_slot: jax.Array  # [S] i32
    penalty_init: jax.Array  # [S] bool
    # Speculative decoding: a sequence with d draft tokens has d + 1 consecutive rows starting at
    # row_start; verify[r] is the draft that follows row r's position (-1 for a sequence's last
    # row): the sequence goes on past row r only if row r draws it. Rows of one sequence share its
    # penalty slot; a row's penalties count the drafts before it as output.
    verify: jax.Array  # [S] i32
    row_start: jax.Array  # [S] i32
    # logit_bias, sparse: up to MAX_LOGIT_BIAS (token id, bias) pairs per row, ids -1 padded. Sent
    # apart from the packed fields, and only by steps where some row has a bias (see pack_logit_bias).
    logit_bias_ids: jax.Array  # [S, MAX_LOGIT_BIAS] i32
    logit_bias_values: jax.Array  # [S, MAX_LOGIT_BIAS] f32


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PenaltyState:
    """Per-request penalty state on the device, one row per slot: whether each token occurred in
    the prompt or output (repetition penalty) and how often it was output (presence, frequency).
    A slot is rebuilt from the history when a request takes it and advanced by every step that
    samples for it, so the host sends a request's history once, not every step."""

    seen: jax.Array  # [slots, V] bool
    counts: jax.Array  # [slots, V] i32


def empty_penalty_state(num_slots: int, vocab: int) -> PenaltyState:
    return PenaltyState(jnp.zeros((num_slots, vocab), jnp.bool_), jnp.zeros((num_slots, vocab), jnp.int32))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SampleOutput:
    token_ids: jax.Array  # [S] i32
    logprobs: jax.Array  # [S] f32 logprob of the sampled token
    top_ids: jax.Array  # [S, MAX_LOGPROBS] i32
    top_logprobs: jax.Array  # [S, MAX_LOGPROBS] f32


def empty_sampling_arrays(num_rows: int, history_len: int, with_history: bool = True,
                          with_logit_bias: bool = True) -> dict[str, np.ndarray]:
    """Host-side buffers with neutral values, to be filled row by row. Without `with_history` the
    [rows, history_len] array is None: no row uses penalties, and the runner supplies it. Likewise
    the logit-bias pair without `with_logit_bias` (no row has a bias)."""
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
        history=np.full((num_rows, history_len), -1, np.int32) if with_history else None,
        prompt_lens=np.zeros(num_rows, np.int32),
        banned=np.full((num_rows, MAX_BANNED), -1, np.int32),
        want_logprobs=np.zeros(num_rows, np.bool_),
        pending_src=np.full(num_rows, -1, np.int32),
        pending_col=np.zeros(num_rows, np.int32),
        penalty_slot=np.full(num_rows, -1, np.int32),
        penalty_init=np.zeros(num_rows, np.bool_),
        verify=np.full(num_rows, -1, np.int32),
        row_start=np.arange(num_rows, dtype=np.int32),
        logit_bias_ids=np.full((num_rows, MAX_LOGIT_BIAS), -1, np.int32) if with_logit_bias else None,
        logit_bias_values=np.zeros((num_rows, MAX_LOGIT_BIAS), np.float32) if with_logit_bias else None,
    )


# The host sends a step's sampling arrays, all but the history, as one int32 buffer (one
# transfer instead of one per field); floats and unsigned ints travel bit for bit.
_PACKED_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seeds", "steps", "prompt_lens", "banned", "want_logprobs",
                  "pending_src", "pending_col", "penalty_slot", "penalty_init", "verify", "row_start")
_PACKED_DTYPES = {k: v.dtype for k, v in empty_sampling_arrays(1, 1).items()}
_LOGIT_BIAS_FIELDS = ("logit_bias_ids", "logit_bias_values")


def packed_sampling_size(num_rows: int) -> int:
    return num_rows * (len(_PACKED_FIELDS) - 1 + MAX_BANNED)


def pack_sampling(samp: dict[str, np.ndarray] | SamplingArrays) -> np.ndarray:
    """Every field but the history, as one flat int32 array (see unpack_sampling)."""
    get = samp.__getitem__ if isinstance(samp, dict) else lambda k: getattr(samp, k)
    parts = []
    for name in _PACKED_FIELDS:
        a = np.asarray(get(name))
        parts.append((a.astype(np.int32) if a.dtype == np.bool_ else a).reshape(-1).view(np.int32))
    return np.concatenate(parts)


def pack_logit_bias(samp: dict[str, np.ndarray] | SamplingArrays) -> np.ndarray | None:
    """The logit-bias pair as one [S, 2 * MAX_LOGIT_BIAS] int32 array (values bit for bit), or
    None when the plan has none. Kept out of pack_sampling: a step without a biased row (nearly
    all of them) then sends nothing for it, and the runner passes a constant kept on the device."""
    get = samp.__getitem__ if isinstance(samp, dict) else lambda k: getattr(samp, k)
    ids, values = get("logit_bias_ids"), get("logit_bias_values")
    if ids is None:
        return None
    return np.concatenate([np.asarray(ids, np.int32), np.asarray(values, np.float32).view(np.int32)], axis=1)


def no_logit_bias(num_rows: int) -> np.ndarray:
    """pack_logit_bias of rows without a bias."""
    return np.concatenate([np.full((num_rows, MAX_LOGIT_BIAS), -1, np.int32),
                           np.zeros((num_rows, MAX_LOGIT_BIAS), np.int32)], axis=1)


def unpack_sampling(buf: jax.Array, num_rows: int, history: jax.Array,
                    logit_bias: jax.Array | None = None) -> SamplingArrays:
    """The SamplingArrays of a pack_sampling buffer (on device, inside the sampler's jit), with
    `logit_bias` from pack_logit_bias (None: no row has a bias)."""
    fields, off = {}, 0
    for name in _PACKED_FIELDS:
        shape = (num_rows, MAX_BANNED) if name == "banned" else (num_rows,)
        n = int(np.prod(shape))
        x = buf[off: off + n].reshape(shape)
        off += n
        dtype = _PACKED_DTYPES[name]
        if dtype == np.bool_:
            x = x != 0
        elif dtype != np.int32:
            x = jax.lax.bitcast_convert_type(x, jnp.dtype(dtype))
        fields[name] = x
    if logit_bias is None:
        logit_bias = jnp.asarray(no_logit_bias(num_rows))
    fields["logit_bias_ids"] = logit_bias[:, :MAX_LOGIT_BIAS]
    fields["logit_bias_values"] = jax.lax.bitcast_convert_type(logit_bias[:, MAX_LOGIT_BIAS:], jnp.float32)
    return SamplingArrays(history=history, **fields)


def apply_logit_bias(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """Each row's biases added to its logits (the first thing done to them, as vLLM does: before
    penalties, temperature and truncation). A batch without a biased row skips the scatter."""
    valid = s.logit_bias_ids >= 0

    def add(l):  # -1 padding (and any id past the vocabulary) goes out of range and is dropped
        rows, vocab = l.shape
        row_idx = jnp.broadcast_to(jnp.arange(rows)[:, None], valid.shape)
        return l.at[row_idx, jnp.where(valid, s.logit_bias_ids, vocab)].add(
            jnp.where(valid, s.logit_bias_values, 0.0), mode="drop")

    return jax.lax.cond(jnp.any(valid), add, lambda l: l, logits)


def _history_with_pending(s: SamplingArrays, prev_ids: jax.Array | None) -> jax.Array:
    """The history with each row's pending token (sampled by the previous step) filled in."""
    if prev_ids is None:
        return s.history
    hist = jnp.asarray(s.history)
    rows = jnp.arange(hist.shape[0])
    has = s.pending_src >= 0
    tok = prev_ids[jnp.maximum(s.pending_src, 0)]
    return hist.at[rows, s.pending_col].set(jnp.where(has, tok, hist[rows, s.pending_col]))


def _history_state(s: SamplingArrays, hist: jax.Array, vocab: int) -> tuple[jax.Array, jax.Array]:
    """(seen [S, V] bool, output counts [S, V] i32) of each row's history."""
    rows = hist.shape[0]
    valid = hist >= 0
    is_output = jnp.arange(hist.shape[1])[None, :] >= s.prompt_lens[:, None]
    row_idx = jnp.broadcast_to(jnp.arange(rows)[:, None], hist.shape)
    tok = jnp.where(valid, hist, 0)
    seen = jnp.zeros((rows, vocab), jnp.bool_).at[row_idx, tok].max(valid)
    counts = jnp.zeros((rows, vocab), jnp.int32).at[row_idx, tok].add((valid & is_output).astype(jnp.int32))
    return seen, counts


def _apply_penalties(logits: jax.Array, s: SamplingArrays, seen: jax.Array, counts: jax.Array) -> jax.Array:
    rp = s.repetition_penalty[:, None]
    # HF/vLLM convention: divide positive logits, multiply negative ones, for every seen token.
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    out_counts = counts.astype(jnp.float32)
    logits = logits - s.frequency_penalty[:, None] * out_counts
    return logits - s.presence_penalty[:, None] * (out_counts > 0)


def _slot_rows(state: PenaltyState, s: SamplingArrays, prev_ids: jax.Array | None
               ) -> tuple[jax.Array, jax.Array, PenaltyState]:
    """Each row's (seen, counts) from its slot, rows with `penalty_init` rebuilt from their
    history and stored back; rows without a slot get none (their penalties are neutral)."""
    num_slots, vocab = state.counts.shape
    has = s.penalty_slot >= 0
    slot = jnp.maximum(s.penalty_slot, 0)
    seen, counts = state.seen[slot], state.counts[slot]

    def rebuild(args):
        seen, counts, state = args
        h_seen, h_counts = _history_state(s, _history_with_pending(s, prev_ids), vocab)
        init = (s.penalty_init & has)[:, None]
        seen, counts = jnp.where(init, h_seen, seen), jnp.where(init, h_counts, counts)
        dest = jnp.where(s.penalty_init & has, s.penalty_slot, num_slots)  # others: out of range, dropped
        state = PenaltyState(state.seen.at[dest].set(seen, mode="drop"), state.counts.at[dest].set(counts, mode="drop"))
        return seen, counts, state

    seen, counts, state = jax.lax.cond(jnp.any(s.penalty_init & has), rebuild, lambda a: a, (seen, counts, state))

    def with_drafts(seen_counts):
        seen, counts = seen_counts
        drafts = _drafts_before(s, vocab)
        return seen | (drafts > 0), counts + drafts

    seen, counts = jax.lax.cond(jnp.any(s.verify >= 0), with_drafts, lambda a: a, (seen, counts))
    return seen & has[:, None], jnp.where(has[:, None], counts, 0), state


def _drafts_before(s: SamplingArrays, vocab: int) -> jax.Array:
    """[S, V] counts of the draft tokens that precede each row within its sequence (the output a
    row's position follows, beyond what the penalty state holds)."""
    rows = s.verify.shape[0]
    one_hot = jnp.zeros((rows, vocab), jnp.int32).at[jnp.arange(rows), jnp.where(s.verify >= 0, s.verify, vocab)
                                                     ].add(1, mode="drop")
    before = jnp.cumsum(one_hot, axis=0) - one_hot  # rows strictly before each row
    return before - before[s.row_start]


def emitted_rows(s: SamplingArrays, tokens: jax.Array) -> jax.Array:
    """[S] bool: rows whose drawn token the sequence keeps, those at or before its first rejected
    draft (every row of a sequence without drafts). The host applies the same rule to the ids."""
    broke = ((s.verify >= 0) & (tokens != s.verify)).astype(jnp.int32)
    before = jnp.cumsum(broke) - broke
    return before == before[s.row_start]


def _count_sampled(state: PenaltyState, s: SamplingArrays, tokens: jax.Array) -> PenaltyState:
    """The step's kept tokens added to their rows' slots (what the next step's penalties see)."""
    num_slots = state.counts.shape[0]
    dest = jnp.where((s.penalty_slot >= 0) & emitted_rows(s, tokens), s.penalty_slot, num_slots)
    return PenaltyState(state.seen.at[dest, tokens].set(True, mode="drop"),
                        state.counts.at[dest, tokens].add(1, mode="drop"))


# ---- stochastic sampling ---------------------------------------------------------------------
# Target distribution (unchanged from the full-sort sampler this replaces): scale by temperature;
# order tokens by scaled logit, ties by lower id (a stable sort); keep the first k (top-k), then,
# on the top-k-renormalized probabilities, keep tokens whose mass before them is < top_p (the first
# token always stays) and whose probability is >= min_p * the largest; sample among those.
# Every kept set is a prefix of that order, so it can be found without sorting the vocabulary:
#   - no top-k / top-p: a masked inverse CDF over the full vocabulary (one uniform per row);
#   - top-k <= _K_MAX, or small top_p: lax.top_k over a bounded set, then the prefix in there;
#   - top-p whose prefix is not known to close within a bounded set: rejection. Draw from the
#     (min-p masked) full distribution and accept iff the mass strictly before the draw is
#     < top_p; the kept mass is >= top_p, so a draw is accepted with probability >= top_p.
#     Rows still rejected get more rounds, then the exact full sort, so that correctness never
#     depends on a bound.

_BLOCK = 256  # inverse-CDF block: block sums over the vocabulary, then one cumsum inside a block
_K_BUCKETS = (64, 256, 1024, 4096)  # lax.top_k sizes; its cost grows fast with k on CPU
_K_MAX = _K_BUCKETS[-1]
_SMALL_TOP_P = 0.5  # below this a rejection round is too often lost; try the top-k set first
_ROUNDS = 32  # rejection rounds for rows left over from the first one, before the full sort
_PENDING_ROWS = 4  # rows gathered per iteration for those (rare) rows
_SORT_ROUND = 1 << 20  # fold_in tag of the noise used by the full-sort fallback


def _row_key(seed: jax.Array, step: jax.Array) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed), step)


def _round_uniform(key: jax.Array, r: jax.Array | int) -> jax.Array:
    return jax.random.uniform(jax.random.fold_in(key, r), (), jnp.float32)


def _weights(scaled: jax.Array, m: jax.Array, min_p: jax.Array) -> jax.Array:
    """Unnormalized probabilities relative to the row max, zero below the min-p threshold."""
    e = jnp.exp(scaled - m[:, None])
    return jnp.where(e >= min_p[:, None], e, 0.0)


def _pick(cum: jax.Array, w: jax.Array, target: jax.Array) -> jax.Array:
    """First index whose cumulative weight exceeds target, never one of weight 0 (guards
    rounding at the end of a row). cum [R, N], w [R, N], target [R]."""
    n = w.shape[-1]
    pos = jnp.sum(cum <= target[:, None], axis=-1)
    last = jnp.max(jnp.where(w > 0, jnp.arange(n)[None, :], 0), axis=-1)
    return jnp.minimum(pos, last)


def _block_sums(scaled: jax.Array, m: jax.Array, min_p: jax.Array) -> jax.Array:
    rows, vocab = scaled.shape
    return _weights(scaled, m, min_p).reshape(rows, vocab // _BLOCK, _BLOCK).sum(-1)


def _inverse_cdf(scaled: jax.Array, m: jax.Array, min_p: jax.Array, u: jax.Array, bsum: jax.Array) -> jax.Array:
    """Sample id ~ _weights(...) with one uniform per row, in two levels so that only the block
    sums (bsum, from _block_sums) touch the whole vocabulary. scaled [R, V], V a multiple of _BLOCK."""
    rows, vocab = scaled.shape
    nb = vocab // _BLOCK
    bcum = jnp.cumsum(bsum, axis=-1)
    target = u * bcum[:, -1]
    blk = _pick(bcum, bsum, target)
    before = jnp.where(blk > 0, jnp.take_along_axis(bcum, jnp.maximum(blk - 1, 0)[:, None], -1)[:, 0], 0.0)
    inner_s = jnp.take_along_axis(scaled.reshape(rows, nb, _BLOCK), blk[:, None, None], 1)[:, 0]
    inner = _weights(inner_s, m, min_p)
    pos = _pick(jnp.cumsum(inner, axis=-1), inner, target - before)
    return (blk * _BLOCK + pos).astype(jnp.int32)


def _mass_before(scaled: jax.Array, m: jax.Array, cand: jax.Array) -> jax.Array:
    """Unnormalized mass of the tokens that precede cand in (value desc, id asc) order."""
    s_c = jnp.take_along_axis(scaled, cand[:, None], -1)
    ids = jnp.arange(scaled.shape[1])[None, :]
    precedes = (scaled > s_c) | ((scaled == s_c) & (ids < cand[:, None]))
    return jnp.sum(jnp.where(precedes, jnp.exp(scaled - m[:, None]), 0.0), axis=-1)


def _sample_sorted(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
                   keys: jax.Array) -> jax.Array:
    """The full-sort sampler (the previous implementation), kept as the exact fallback."""
    vocab = scaled.shape[1]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k > 0, top_k, vocab)[:, None]
    sorted_logits = jnp.where(rank < k, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p[:, None]) & (probs >= min_p[:, None] * probs[:, :1])
    sorted_logits = jnp.where(keep | (rank == 0), sorted_logits, -jnp.inf)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(jax.random.fold_in(key, _SORT_ROUND), (vocab,)))(keys)
    choice = jnp.argmax(sorted_logits + gumbel, axis=-1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def _row_block(num_rows: int) -> int:
    return next(r for r in (16, 8, 4, 2, 1) if num_rows % r == 0)


def _by_row_blocks(need: jax.Array, fn: Callable[..., Any], init: Any, *arrays: jax.Array) -> Any:
    """Run fn on each contiguous block of rows that holds a row in need, and write its results
    into init for those rows only: a path few rows take costs only their blocks."""
    rows = need.shape[0]
    r = _row_block(rows)

    def body(b, out):
        start = b * r
        sl = lambda a: jax.lax.dynamic_slice_in_dim(a, start, r, 0)
        sub_need = sl(need)

        def run(out):
            res = fn(*[sl(a) for a in arrays])
            return jax.tree.map(lambda o, x: jax.lax.dynamic_update_slice_in_dim(
                o, jnp.where(sub_need.reshape((r,) + (1,) * (x.ndim - 1)), x, sl(o)), start, 0), out, res)

        return jax.lax.cond(jnp.any(sub_need), run, lambda o: o, out)

    return jax.lax.cond(jnp.any(need), lambda: jax.lax.fori_loop(0, rows // r, body, init), lambda: init)


def _top_k_buckets(vocab: int) -> list[int]:
    return sorted({min(k, vocab) for k in _K_BUCKETS})


def _top_k_path(kk: int, scaled: jax.Array, m: jax.Array, z: jax.Array, k_eff: jax.Array, top_p: jax.Array,
                min_p: jax.Array, u: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sample within the lax.top_k set of size kk. Returns (token, closed): closed is False where
    the kept prefix may extend past the set (only possible without top-k); that token is unused."""
    vocab = scaled.shape[1]
    vals, idx = jax.lax.top_k(scaled, kk)
    rank = jnp.arange(kk)[None, :]
    in_k = (k_eff[:, None] <= 0) | (rank < k_eff[:, None])
    # the row max comes in as m: slicing vals[:, :1] here makes XLA's CPU compiler turn
    # lax.top_k back into a full sort (seen with jax 0.10.2)
    e = jnp.where(in_k, jnp.exp(vals - m[:, None]), 0.0)
    total = jnp.where(k_eff > 0, jnp.sum(e, axis=-1), z)  # top-k renormalizes within k
    cum = jnp.cumsum(e, axis=-1)
    keep = ((cum - e < top_p[:, None] * total[:, None]) | (top_p[:, None] >= 1.0)) & (e >= min_p[:, None])
    keep = (keep & in_k) | (rank == 0)
    w = jnp.where(keep, e, 0.0)
    wcum = jnp.cumsum(w, axis=-1)
    pos = _pick(wcum, w, u * wcum[:, -1])
    tok = jnp.take_along_axis(idx, pos[:, None], -1)[:, 0].astype(jnp.int32)
    closed = (k_eff > 0) | ~keep[:, -1] | (kk >= vocab)
    return tok, closed


def _pending_rows(scaled: jax.Array, m: jax.Array, z: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array, keys: jax.Array, may_reject: jax.Array, valid: jax.Array) -> jax.Array:
    """Rows not settled by the fast paths: more rejection rounds (where allowed), then the full
    sort for what is left. Rows not valid are padding and must not start the sort."""
    rows, vocab = scaled.shape
    nb = vocab // _BLOCK
    wb = _weights(scaled, m, min_p).reshape(rows, nb, _BLOCK)
    bsum = wb.sum(-1)
    bcum = jnp.cumsum(bsum, axis=-1)

    def draw(r):
        u = jax.vmap(_round_uniform, in_axes=(0, None))(keys, r)
        target = u * bcum[:, -1]
        blk = _pick(bcum, bsum, target)
        before = jnp.where(blk > 0, jnp.take_along_axis(bcum, jnp.maximum(blk - 1, 0)[:, None], -1)[:, 0], 0.0)
        inner = jnp.take_along_axis(wb, blk[:, None, None], 1)[:, 0]
        pos = _pick(jnp.cumsum(inner, axis=-1), inner, target - before)
        return (blk * _BLOCK + pos).astype(jnp.int32)

    def cond(state):
        r, _, done = state
        return (r <= _ROUNDS) & ~jnp.all(done)

    def body(state):
        r, tok, done = state
        cand = draw(r)
        ok = may_reject & ~done & (_mass_before(scaled, m, cand) < top_p * z)
        return r + 1, jnp.where(ok, cand, tok), done | ok

    may_reject = may_reject & valid
    _, tok, done = jax.lax.while_loop(cond, body, (jnp.int32(1), jnp.zeros(rows, jnp.int32), ~may_reject))
    done = done & may_reject
    exact = jax.lax.cond(jnp.any(valid & ~done), lambda: _sample_sorted(scaled, top_k, top_p, min_p, keys),
                         lambda: tok)
    return jnp.where(done, tok, exact)


def _sample_stochastic(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    rows, vocab = logits.shape
    stoch = s.temperature > 0
    scaled = logits / jnp.maximum(jnp.where(stoch, s.temperature, 1.0), 1e-6)[:, None]
    pad = -vocab % _BLOCK
    if pad:  # -inf padding has zero weight and sorts last
        scaled = jnp.pad(scaled, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    k_eff = jnp.where((s.top_k > 0) & (s.top_k < vocab), s.top_k, 0)
    has_p = s.top_p < 1.0
    use_top_k = stoch & (k_eff > 0) & (k_eff <= _K_MAX)
    exact_only = stoch & (k_eff > _K_MAX)
    nucleus = stoch & (k_eff == 0) & has_p
    small_p = nucleus & (s.top_p < _SMALL_TOP_P)
    full = stoch & (k_eff == 0) & ~has_p  # temperature and min-p only
    keys = jax.vmap(_row_key)(s.seeds, s.steps)
    u0 = jax.vmap(_round_uniform, in_axes=(0, None))(keys, 0)
    m = jnp.max(scaled, axis=-1)
    # exp over the vocabulary is the costliest pass: one for the normalizer and the block sums
    # alike, a second one only if some row masks by min-p
    no_min_p = jnp.zeros_like(s.min_p)
    unmasked = _block_sums(scaled, m, no_min_p)
    z = jnp.sum(unmasked, axis=-1)
    bsum = jax.lax.cond(jnp.any(stoch & (s.min_p > 0)), lambda: _block_sums(scaled, m, s.min_p), lambda: unmasked)

    # one draw from the (min-p masked) full distribution: the answer for `full` rows, the first
    # rejection candidate for nucleus rows
    cand = _inverse_cdf(scaled, m, s.min_p, u0, bsum)
    tk_rows = use_top_k | small_p
    # Each row gets the smallest bucket that holds its own k (small-top_p rows the smallest
    # bucket), never one chosen by its neighbours: a bigger set could close a prefix that its own
    # does not, which would change the token with the batch.
    buckets = _top_k_buckets(scaled.shape[1])
    own = jnp.sum(jnp.asarray(buckets)[None, :] < jnp.where(k_eff > 0, k_eff, 1)[:, None], axis=-1)
    tk = (jnp.zeros(rows, jnp.int32), jnp.zeros(rows, jnp.bool_))
    for b, kk in enumerate(buckets):
        tk = _by_row_blocks(tk_rows & (own == b), functools.partial(_top_k_path, kk), tk,
                            scaled, m, z, k_eff, s.top_p, s.min_p, u0)
    tk_tok, tk_closed = tk
    by_top_k = use_top_k | (small_p & tk_closed)
    reject = nucleus & ~by_top_k

    def first_round(scaled, m, z, cand, top_p):
        return _mass_before(scaled, m, cand) < top_p * z

    accepted = _by_row_blocks(reject, first_round, jnp.zeros(rows, jnp.bool_), scaled, m, z, cand, s.top_p)
    pending = (reject & ~accepted) | exact_only

    def more(state):
        tok, left = state
        idx = jnp.nonzero(left, size=_PENDING_ROWS, fill_value=rows)[0]
        valid = idx < rows
        g = jnp.minimum(idx, rows - 1)
        res = _pending_rows(scaled[g], m[g], z[g], s.top_k[g], s.top_p[g], s.min_p[g], keys[g], reject[g], valid)
        tok = tok.at[jnp.where(valid, idx, rows)].set(res, mode="drop")
        return tok, left.at[jnp.where(valid, idx, rows)].set(False, mode="drop")

    pend_tok, _ = jax.lax.while_loop(lambda st: jnp.any(st[1]), more, (jnp.zeros(rows, jnp.int32), pending))
    tok = jnp.where(by_top_k, tk_tok, cand)
    return jnp.where(pending, pend_tok, tok)


def _first(hit: jax.Array) -> jax.Array:
    n = hit.shape[-1]
    return jnp.min(jnp.where(hit, jnp.arange(n, dtype=jnp.int32), n), axis=-1)


def _argmax(logits: jax.Array) -> jax.Array:
    """jnp.argmax's answer (first maximum; first NaN if any), found through block maxima: XLA's
    CPU backend runs argmax's paired-value reduction, and even a max-then-first-index pass over
    [128, 49152], tens of times slower than a plain max over blocks (measured here)."""
    rows, vocab = logits.shape
    blk_size = next((b for b in (256, 128, 64, 32, 16) if vocab % b == 0), None)
    if blk_size is None:  # odd vocabulary sizes: the two-reduction form over whole rows
        m = jnp.max(logits, axis=-1, keepdims=True)
        return jnp.minimum(_first((logits == m) | jnp.isnan(logits)), vocab - 1).astype(jnp.int32)
    nb = vocab // blk_size
    xb = logits.reshape(rows, nb, blk_size)
    bm = jnp.max(xb, axis=-1)
    m = jnp.max(bm, axis=-1, keepdims=True)
    nan_blk = jnp.any(jnp.isnan(xb), axis=-1)  # a block max need not carry a NaN through
    any_nan = jnp.any(nan_blk, axis=-1, keepdims=True)
    blk = jnp.minimum(_first(jnp.where(any_nan, nan_blk, bm == m)), nb - 1)
    inner = jnp.take_along_axis(xb, blk[:, None, None], 1)[:, 0]
    pos = _first(jnp.where(any_nan, jnp.isnan(inner), inner == m))
    return (blk * blk_size + jnp.minimum(pos, blk_size - 1)).astype(jnp.int32)


def allowed_tokens(bitmask: jax.Array, vocab: int) -> jax.Array:
    """[S, ceil(V/32)] packed int32 (bit t % 32 of word t // 32: token t allowed) -> [S, V] bool."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)[None, None, :]) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab] != 0


def _apply_token_mask(logits: jax.Array, unbanned: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Disallowed tokens -> -inf. A row left with nothing (min_tokens bans the only tokens its
    grammar allows, e.g. EOS once the output is complete) keeps its allowed tokens unbanned: the
    grammar wins over min_tokens."""
    allowed = allowed_tokens(bitmask, logits.shape[1])
    masked = jnp.where(allowed, logits, -jnp.inf)
    empty = ~jnp.any(masked > -jnp.inf, axis=-1, keepdims=True)
    return jnp.where(empty, jnp.where(allowed, unbanned, -jnp.inf), masked)


def sample(logits: jax.Array, s: SamplingArrays, prev_ids: jax.Array | None = None,
           token_bitmask: jax.Array | None = None) -> SampleOutput:
    """logits [S, V] float32 -> sampled ids and logprobs (of the raw model distribution), with
    penalties from each row's history (stateless: the reference for `sample_with_state`).
    `prev_ids`: the previous step's sampled ids, for rows with a pending token (overlap).
    `token_bitmask`: [S, ceil(V/32)] int32 allowed tokens (structured output); a row of all ones
    (-1) is unconstrained, and a batch without a constrained row skips the masking entirely."""
    vocab = logits.shape[1]
    any_penalty = jnp.any((s.repetition_penalty != 1.0) | (s.presence_penalty != 0) | (s.frequency_penalty != 0))
    penalized = jax.lax.cond(
        any_penalty,
        lambda l: _apply_penalties(l, s, *_history_state(s, _history_with_pending(s, prev_ids), vocab)),
        lambda l: l, apply_logit_bias(logits, s))
    return _sample_penalized(penalized, logits, s, token_bitmask)


def sample_with_state(logits: jax.Array, s: SamplingArrays, prev_ids: jax.Array | None,
                      state: PenaltyState, token_bitmask: jax.Array | None = None
                      ) -> tuple[SampleOutput, PenaltyState]:
    """`sample` with penalties from the device-resident state (rows with a `penalty_slot`),
    which comes back advanced by the sampled tokens. Steps without such rows leave it alone."""
    any_slot = jnp.any(s.penalty_slot >= 0)

    def penalize(args):
        l, state = args
        seen, counts, state = _slot_rows(state, s, prev_ids)
        return _apply_penalties(l, s, seen, counts), state

    penalized, state = jax.lax.cond(any_slot, penalize, lambda a: a, (apply_logit_bias(logits, s), state))
    out = _sample_penalized(penalized, logits, s, token_bitmask)
    state = jax.lax.cond(any_slot, lambda st: _count_sampled(st, s, out.token_ids), lambda st: st, state)
    return out, state


def _sample_penalized(logits: jax.Array, raw_logits: jax.Array, s: SamplingArrays,
                      token_bitmask: jax.Array | None) -> SampleOutput:
    """Sampling once penalties (and then bans and the token mask) are applied; logprobs are of
    `raw_logits`."""
    rows, vocab = logits.shape
    banned_valid = s.banned >= 0

    def apply_bans(l):  # -1 padding (and ids past the vocabulary) go out of range and are dropped
        row_idx = jnp.broadcast_to(jnp.arange(rows)[:, None], s.banned.shape)
        return l.at[row_idx, jnp.where(banned_valid, s.banned, vocab)].set(-jnp.inf, mode="drop")

    unbanned = logits
    logits = jax.lax.cond(jnp.any(banned_valid), apply_bans, lambda l: l, logits)
    if token_bitmask is not None:
        logits = jax.lax.cond(jnp.any(token_bitmask != -1), _apply_token_mask, lambda l, u, m: l,
                              logits, unbanned, token_bitmask)
    is_greedy = s.temperature == 0.0
    # each path runs only if some row takes it; a row's token never depends on which others ran
    greedy = jax.lax.cond(jnp.any(is_greedy), _argmax, lambda l: jnp.zeros(rows, jnp.int32), logits)
    sampled = jax.lax.cond(jnp.all(is_greedy), lambda l, _: jnp.zeros(rows, jnp.int32), _sample_stochastic, logits, s)
    tokens = jnp.where(is_greedy, greedy, sampled)

    def logprobs(l, toks):
        lp = jax.nn.log_softmax(l, axis=-1)
        top_lp, top_ids = jax.lax.top_k(lp, MAX_LOGPROBS)
        return jnp.take_along_axis(lp, toks[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp

    def no_logprobs(l, toks):  # a full-vocabulary softmax and top-k cost a third of a small step
        return (jnp.zeros(rows, jnp.float32), jnp.zeros((rows, MAX_LOGPROBS), jnp.int32),
                jnp.zeros((rows, MAX_LOGPROBS), jnp.float32))

    token_lp, top_ids, top_lp = jax.lax.cond(jnp.any(s.want_logprobs), logprobs, no_logprobs, raw_logits, tokens)
    return SampleOutput(tokens, token_lp, top_ids, top_lp)
