"""Block hashes for KV-cache events: the chained content hash a router recomputes from tokens.

A page ("block") of page_size tokens is named by hash(parent block's hash, its tokens, extra keys),
the parent of a prompt's first block being a seed hash (vLLM's NONE_HASH). Our radix tree does not
need hashes to match prefixes; they exist only so an outside router that tokenizes a prompt and
hashes it the same way can find the blocks a replica announced. Which hash that is depends on the
router, so three are offered (EngineConfig.prefix_caching_hash_algo):

- "sha256_cbor" (default): vLLM's cross-language algorithm (vllm/utils/hashing.py `sha256_cbor`,
  vllm/v1/core/kv_cache_utils.py `hash_block_tokens`, `init_none_hash`): sha256 of the canonical
  CBOR of the tuple (parent digest: 32 bytes, token ids: tuple, extra keys: None); the seed is
  sha256_cbor(str PYTHONHASHSEED), or 32 random bytes when PYTHONHASHSEED is unset (as in vLLM).
  Events carry the low 64 bits of the digest (`maybe_convert_block_hash`, vLLM's default of
  VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES). The CBOR is written here for this one shape (cbor2 is
  not a dependency); tests check it against cbor2.
- "sha256": vLLM's default algorithm, the same tuple through pickle (protocol 5): reproducible only
  from Python, and pickle's bytes may change between Python versions.
- "siphash13": the keys of vllm-router's older kv_aware code (its src/kv_index/block_hash.rs
  `BlockKeyGenerator`): Rust's DefaultHasher (SipHash-1-3, zero keys) over (seed: u64, parent:
  Option<u64>, tokens: &[u32]), the router's `hash_seed` (default 0) being our PYTHONHASHSEED or 0.
  That code indexed the engine's hashes and looked them up by its own keys, so vLLM's sha256 hashes
  never matched there; these do. vllm-router 0.1.17 keys blocks by their token ids instead and
  takes any of the three (tried; docs/kv_events.md).

Hashes are kept by the radix tree in their internal form (32-byte digests, or ints for siphash13)
and turned into the 64-bit wire form only on the publisher's thread.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import struct
from typing import Callable, Sequence

HASH_ALGOS = ("sha256_cbor", "sha256", "siphash13")

_MASK64 = (1 << 64) - 1

log = logging.getLogger(__name__)


# ---- canonical CBOR (RFC 8949 section 4.2.1) of the few types a block-hash tuple holds --------
def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for info, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | info]) + struct.pack(fmt, n)
    raise ValueError(f"{n} does not fit CBOR's 64-bit argument")


def _cbor(value: object) -> bytes:
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        return b"\xf5" if value else b"\xf4"
    if isinstance(value, int):
        return _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if isinstance(value, str):
        data = value.encode("utf-8")
        return _cbor_head(3, len(data)) + data
    if isinstance(value, (tuple, list)):
        return _cbor_head(4, len(value)) + b"".join(_cbor(v) for v in value)
    raise TypeError(f"no CBOR encoding here for {type(value).__name__}")


def sha256_cbor(value: object) -> bytes:
    return hashlib.sha256(_cbor(value)).digest()


class _TokenCbor(dict):
    """Token id -> its CBOR bytes, filled on first use (a block's tokens then encode by lookups);
    bounded by the vocabulary."""

    def __missing__(self, token: int) -> bytes:
        self[token] = out = _cbor(token)
        return out


_TOKEN_CBOR = _TokenCbor()


def _block_cbor(parent: bytes, tokens: Sequence[int]) -> bytes:
    """_cbor((parent, tuple(tokens), None)) for a 32-byte parent, ~10x faster (the hot case)."""
    return (b"\x83\x58\x20" + parent + _cbor_head(4, len(tokens))
            + b"".join(map(_TOKEN_CBOR.__getitem__, tokens)) + b"\xf6")


def sha256_pickle(value: object) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


# ---- SipHash-1-3 with zero keys: Rust's std DefaultHasher ------------------------------------
def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & _MASK64


def siphash13(data: bytes, k0: int = 0, k1: int = 0) -> int:
    """SipHash-1-3 as a u64 (pure Python, ~40 us a block; the siphash24 package, when installed,
    does it in C: see _siphash13_zero_keys)."""
    v0, v1 = k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D
    v2, v3 = k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573

    def rounds(n: int) -> None:
        nonlocal v0, v1, v2, v3
        for _ in range(n):
            v0 = (v0 + v1) & _MASK64; v1 = _rotl(v1, 13) ^ v0; v0 = _rotl(v0, 32)  # noqa: E702
            v2 = (v2 + v3) & _MASK64; v3 = _rotl(v3, 16) ^ v2  # noqa: E702
            v0 = (v0 + v3) & _MASK64; v3 = _rotl(v3, 21) ^ v0  # noqa: E702
            v2 = (v2 + v1) & _MASK64; v1 = _rotl(v1, 17) ^ v2; v2 = _rotl(v2, 32)  # noqa: E702

    tail_len = len(data) % 8
    for (m,) in struct.iter_unpack("<Q", data[: len(data) - tail_len]):
        v3 ^= m
        rounds(1)
        v0 ^= m
    m = int.from_bytes(data[len(data) - tail_len:], "little") | ((len(data) & 0xFF) << 56)
    v3 ^= m
    rounds(1)
    v0 ^= m
    v2 ^= 0xFF
    rounds(3)
    return v0 ^ v1 ^ v2 ^ v3


try:  # optional accelerator
    import siphash24 as _siphash24

    def _siphash13_zero_keys(data: bytes) -> int:
        return int.from_bytes(_siphash24.siphash13(data, key=bytes(16)).digest(), "little")
except ImportError:
    _siphash13_zero_keys = siphash13


class BlockHasher:
    """Chained block hashes for one algorithm and seed (one per process, like vLLM's NONE_HASH)."""

    def __init__(self, algo: str = "sha256_cbor", seed: str | None = None):
        """seed: what vLLM reads from PYTHONHASHSEED (None: read it from the environment here)."""
        if algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {', '.join(HASH_ALGOS)}; got {algo!r}")
        self.algo = algo
        seed = os.environ.get("PYTHONHASHSEED") if seed is None else seed
        if algo == "siphash13":
            self._seed = int(seed) if seed not in (None, "random") else 0  # the router's hash_seed
            self.hash_block: Callable[[object, Sequence[int]], object] = self._siphash_block
            return
        self._fn = sha256_cbor if algo == "sha256_cbor" else sha256_pickle
        if seed in (None, "random"):
            log.warning("PYTHONHASHSEED is not set: KV-event block hashes start from a random seed, so no "
                        "router can recompute them (as in vLLM); set it to the value the router uses")
        # PYTHONHASHSEED="random" counts as unset, as in Python itself.
        self.none_hash = self._fn(seed) if seed not in (None, "random") else os.urandom(32)
        self.hash_block = self._sha_block

    def _sha_block(self, parent: object, tokens: Sequence[int]) -> bytes:
        """parent: the previous block's digest, or None for a prompt's first block."""
        parent = self.none_hash if parent is None else parent
        if self._fn is sha256_cbor:
            return hashlib.sha256(_block_cbor(parent, tokens)).digest()
        return self._fn((parent, tuple(tokens), None))

    def _siphash_block(self, parent: object, tokens: Sequence[int]) -> int:
        # The bytes Rust's derived Hash writes: u64 seed, Option discriminant (isize) and payload,
        # the slice's length (usize) and its u32 elements, all little-endian (x86-64, aarch64).
        head = struct.pack("<QQ", self._seed, 0) if parent is None else struct.pack("<QQQ", self._seed, 1, parent)
        return _siphash13_zero_keys(head + struct.pack(f"<Q{len(tokens)}I", len(tokens), *tokens))

    def chain(self, parent: object, token_ids: Sequence[int], page_size: int) -> list:
        """Hashes of the whole pages of token_ids, following the block hashed `parent`."""
        out = []
        for start in range(0, len(token_ids) - page_size + 1, page_size):
            parent = self.hash_block(parent, token_ids[start: start + page_size])
            out.append(parent)
        return out

    @staticmethod
    def external(value: object) -> int:
        """The event form: vLLM's int block hash (the low 64 bits of the big-endian digest)."""
        return value if isinstance(value, int) else int.from_bytes(value[-8:], "big")
