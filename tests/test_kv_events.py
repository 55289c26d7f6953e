"""KV-cache events: a ZMQ subscriber rebuilds a replica's cached pages from the wire bytes alone
(msgpack decoded by hand, laid out as vLLM documents it) and must match the radix cache exactly,
through inserts, evictions under memory pressure, resets, a full queue and a late join."""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import signal
import time

import msgpack
import pytest
import zmq
from conftest import make_tiny_checkpoint, small_engine_options
from server_utils import free_port, kv_events_json

from jaxserve.cache.block_hash import BlockHasher
from jaxserve.cache.kv_events import KVEventRecorder, KVEventsConfig, ZmqEventPublisher, offset_endpoint
from jaxserve.cache.page_pool import PagePool
from jaxserve.cache.radix_cache import RadixCache

SEED = "0"  # PYTHONHASHSEED for the hashes the mirror recomputes


# ---- an independent subscriber ---------------------------------------------------------------
def cbor_sha256(value) -> bytes:
    import cbor2

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


class Mirror:
    """What a router keeps: block hash -> (parent hash, tokens), from the PUB stream and the replay
    socket (vLLM's protocol: a DEALER sends [b"", start seq]; replies [b"", seq, payload], then
    seq -1 with an empty payload). Checks the wire format and, for sha256_cbor, every hash."""

    def __init__(self, port: int, topic: bytes = b"", check_sha256_cbor: bool = True, late: bool = False,
                 replay_port: int | None = None):
        ctx = zmq.Context.instance()
        self.port = port
        self.replay_port = port + 1 if replay_port is None else replay_port
        self.sub = ctx.socket(zmq.SUB)
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.sub.subscribe(topic)
        self.topic = topic
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.digests: dict[int, bytes] = {}
        self.check = check_sha256_cbor
        self.next_seq = 0
        self.ranks: set[int] = set()
        self.tags: list[str] = []
        self.replayed = 0
        if not late:
            time.sleep(0.3)  # PUB drops what it sends before the subscription arrives

    def close(self) -> None:
        self.sub.close(linger=0)

    @property
    def hashes(self) -> set[int]:
        return set(self.blocks)

    def pump(self, quiet: float = 0.2) -> None:
        """Apply every live batch, then replay whatever the PUB socket had dropped."""
        while self.sub.poll(int(quiet * 1000)):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == self.topic and len(seq_bytes) == 8
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.next_seq:
                self.replay()
            if seq == self.next_seq:
                self.apply(payload)
                self.next_seq += 1
        self.replay()

    def replay(self) -> None:
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{self.replay_port}")
        dealer.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
        try:
            while True:
                assert dealer.poll(5000), "no replay answer"
                empty, seq_bytes, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == -1:
                    assert empty == b"" and payload == b""
                    return
                assert seq == self.next_seq, f"replay gap: got {seq}, wanted {self.next_seq}"
                self.apply(payload)
                self.next_seq += 1
                self.replayed += 1
        finally:
            dealer.close(linger=0)

    def apply(self, payload: bytes) -> None:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        assert isinstance(batch, list) and len(batch) == 3, batch  # [ts, events, data_parallel_rank]
        ts, events, rank = batch
        assert isinstance(ts, float) and abs(ts - time.time()) < 60 and isinstance(rank, int)
        self.ranks.add(rank)
        for ev in events:
            if isinstance(ev, dict):  # later vLLM: tagged maps
                tag, f = ev["type"], ev
            else:  # vLLM 0.23 and earlier: tagged arrays, fields in declaration order
                tag = ev[0]
                names = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                                         "lora_id", "medium", "lora_name"),
                         "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}[tag]
                assert len(ev) == 1 + len(names), ev
                f = dict(zip(names, ev[1:]))
            self.tags.append(tag)
            if tag == "AllBlocksCleared":
                assert set(f) <= {"type"}
                self.blocks.clear()
            elif tag == "BlockStored":
                self._stored(f)
            else:
                assert f["medium"] == "GPU"
                for h in f["block_hashes"]:
                    assert h in self.blocks, f"removal of unknown block {h}"
                    del self.blocks[h]
                gone = set(f["block_hashes"])
                assert not any(p in gone for p, _ in self.blocks.values()), "a block outlived its parent"

    def _stored(self, f: dict) -> None:
        assert f["lora_id"] is None and f["lora_name"] is None and f["medium"] == "GPU"
        hashes, parent, tokens, size = f["block_hashes"], f["parent_block_hash"], f["token_ids"], f["block_size"]
        assert hashes and len(tokens) == len(hashes) * size
        assert all(isinstance(h, int) and 0 <= h < 2**64 for h in hashes)
        assert parent is None or parent in self.blocks, "stored under a parent the subscriber lacks"
        digest = None
        if self.check:
            digest = cbor_sha256(SEED) if parent is None else self.digests[parent]
        for i, h in enumerate(hashes):
            block = tuple(tokens[i * size: (i + 1) * size])
            assert h not in self.blocks, "a block stored twice"
            if self.check:  # vLLM's hash_block_tokens with sha256_cbor, the low 64 bits
                digest = cbor_sha256((digest, block, None))
                assert int.from_bytes(digest, "big") & (2**64 - 1) == h, "block hash is not vLLM's sha256_cbor"
                self.digests[h] = digest
            self.blocks[h] = (parent, block)
            parent = h


# ---- hashes ------------------------------------------------------------------------------------
def test_block_hashes_match_independent_references():
    import cbor2

    siphash24 = pytest.importorskip("siphash24")
    tokens = list(range(100, 116))
    h = BlockHasher("sha256_cbor", SEED)
    none = hashlib.sha256(cbor2.dumps("0", canonical=True)).digest()
    first = hashlib.sha256(cbor2.dumps((none, tuple(tokens[:8]), None), canonical=True)).digest()
    second = hashlib.sha256(cbor2.dumps((first, tuple(tokens[8:]), None), canonical=True)).digest()
    assert h.chain(None, tokens, 8) == [first, second]
    assert h.external(second) == int.from_bytes(second, "big") % 2**64
    big = [0, 23, 24, 255, 256, 65535, 65536, 2**31]  # every CBOR integer width
    assert h.hash_block(first, big) == hashlib.sha256(cbor2.dumps((first, tuple(big), None), canonical=True)).digest()

    p = BlockHasher("sha256", SEED)
    pnone = hashlib.sha256(pickle.dumps("0", protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert p.chain(None, tokens[:8], 8) == [hashlib.sha256(pickle.dumps((pnone, tuple(tokens[:8]), None),
                                                                      protocol=pickle.HIGHEST_PROTOCOL)).digest()]

    def router_key(seed: int, parent: int | None, block: list[int]) -> int:
        # vllm-router's BlockKeyGenerator: DefaultHasher (SipHash-1-3, zero keys) fed seed.hash(),
        # Option<u64>.hash() (discriminant as isize, then the value), [u32].hash() (len, then data).
        data = seed.to_bytes(8, "little") + (b"\0" * 8 if parent is None else (1).to_bytes(8, "little")
                                             + parent.to_bytes(8, "little"))
        data += len(block).to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in block)
        return int.from_bytes(siphash24.siphash13(data, key=bytes(16)).digest(), "little")

    from jaxserve.cache.block_hash import siphash13

    for n in (0, 7, 8, 9, 63, 64, 100):  # the pure-Python SipHash (used without siphash24 installed)
        data = bytes(range(n))
        assert siphash13(data) == int.from_bytes(siphash24.siphash13(data, key=bytes(16)).digest(), "little")
    s = BlockHasher("siphash13", "7")
    k1 = router_key(7, None, tokens[:8])
    assert s.chain(None, tokens, 8) == [k1, router_key(7, k1, tokens[8:])]
    assert s.external(k1) == k1
    # Known answers from Rust itself (rustc 1.95, std DefaultHasher, the router's compute_block_hash
    # body: seed.hash(h); parent.hash(h); tokens.hash(h); h.finish()).
    assert s.chain(None, tokens, 8) == [13928557431392599691, 2127825339292582985]
    assert BlockHasher("siphash13", "0").hash_block(2**64 - 1, [0, 23, 24, 255, 256, 65535, 65536, 151_000]) \
        == 12923077746705967152
    # Unseeded, vLLM draws a random first parent: hashes then differ between processes.
    assert BlockHasher("sha256_cbor", "random").none_hash != BlockHasher("sha256_cbor", "random").none_hash


def test_kv_events_config_parses_vllms_json():
    c = KVEventsConfig.parse('{"enable_kv_cache_events": true, "topic": "kv@", "buffer_steps": 5}')
    assert (c.publisher, c.endpoint, c.replay_endpoint, c.topic, c.buffer_steps, c.active) == \
        ("zmq", "tcp://*:5557", None, "kv@", 5, True)
    assert not KVEventsConfig.parse(None).active
    assert not KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "null"}).active
    for bad in ('{"enable_kv_cache_events": true, "port": 1}', "{not json", '{"publisher": "kafka"}',
                '{"max_queue_size": 0}', "[1]"):
        with pytest.raises(ValueError):
            KVEventsConfig.parse(bad)
    from jaxserve.config import EngineConfig, config_from_args
    from jaxserve.serve import parse_args

    cfg = config_from_args(parse_args(["--kv-events-config", '{"enable_kv_cache_events": true}',
                                       "--prefix-caching-hash-algo", "siphash13"]))
    assert KVEventsConfig.parse(cfg.kv_events_config).active and cfg.prefix_caching_hash_algo == "siphash13"
    with pytest.raises(ValueError):
        EngineConfig(kv_events_config='{"enable_kv_cache_events": 1, "bogus": 2}')
    with pytest.raises(ValueError):
        EngineConfig(prefix_caching_hash_algo="md5")
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"


# ---- the radix cache alone ---------------------------------------------------------------------
def make_cache(port: int, num_pages: int = 24, page_size: int = 4, rank: int = 0, algo: str = "sha256_cbor",
               **extra) -> tuple[RadixCache, ZmqEventPublisher]:
    cfg = KVEventsConfig.parse(kv_events_json(port - rank, **extra))
    hasher = BlockHasher(algo, SEED)
    pub = ZmqEventPublisher(cfg, rank, hasher.external)
    return RadixCache(PagePool(num_pages, page_size), KVEventRecorder(hasher, pub)), pub


def check(cache: RadixCache, pub: ZmqEventPublisher, mirror: Mirror) -> None:
    cache.events.flush()  # what the engine does once per step
    assert pub.drain()
    mirror.pump()
    cache.check_invariants()
    cache.pool.check_invariants(cache.external_refs())
    assert mirror.hashes == cache.block_hashes()


def run_sequence(cache: RadixCache, tokens: list[int]) -> None:
    """A request's life as the scheduler leads it: match, lock, compute the rest, insert, release."""
    pool, ps = cache.pool, cache.page_size
    pages, n, node = cache.match_prefix(tokens)
    cache.lock(node)
    pool.append_shared("r", pages)
    need = len(tokens) // ps - len(pages)
    if need > pool.num_free:
        cache.evict(need - pool.num_free)
    pool.ensure_capacity("r", len(tokens) // ps * ps)
    cache.insert(tokens[: len(tokens) // ps * ps], pool.pages_of("r"))
    cache.unlock(node)
    pool.free("r")


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_subscriber_rebuilds_the_radix_cache_exactly(encoding):
    port = free_port()
    cache, pub = make_cache(port, event_encoding=encoding)
    mirror = Mirror(port)
    try:
        rng = random.Random(0)
        stems = [[rng.randrange(50) for _ in range(rng.randrange(4, 13))] for _ in range(4)]
        for step in range(40):  # shared stems, random tails: splits, hits, growth and LRU evictions
            tokens = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(0, 14))]
            run_sequence(cache, tokens)
            if step % 3 == 0:
                check(cache, pub, mirror)
        check(cache, pub, mirror)
        assert cache.evicted_pages > 0 and "BlockRemoved" in mirror.tags

        # A reset while a path is locked keeps that path: removals only, no AllBlocksCleared.
        keep = stems[0][:8]
        run_sequence(cache, keep)
        _, n, node = cache.match_prefix(keep)
        assert n == 8
        cache.lock(node)
        assert mirror.tags.count("AllBlocksCleared") == 1 and mirror.tags[0] == "AllBlocksCleared"  # a new replica
        cache.reset()
        check(cache, pub, mirror)
        assert mirror.tags.count("AllBlocksCleared") == 1 and len(mirror.hashes) == 2
        cache.unlock(node)
        cache.reset()  # now everything goes: one AllBlocksCleared
        check(cache, pub, mirror)
        assert mirror.tags[-1] == "AllBlocksCleared" and mirror.hashes == set() == cache.block_hashes()
        assert cache.pool.num_free == cache.pool.num_pages - 1
    finally:
        mirror.close()
        pub.close()


def test_late_joiner_catches_up_through_the_replay_socket():
    port = free_port()
    cache, pub = make_cache(port, rank=1, algo="siphash13", buffer_steps=100)  # rank 1: port + 1
    try:
        for i in range(6):  # published before anyone listens: PUB drops them all
            run_sequence(cache, [i, i, 1, 2, 3, 4, 5, 6, 7])
            cache.events.flush()
        assert pub.drain()
        mirror = Mirror(port, check_sha256_cbor=False, late=True)
        mirror.pump()  # nothing live: the replay from 0 brings all six batches
        assert mirror.replayed == 6 and mirror.hashes == cache.block_hashes() and mirror.ranks == {1}
        time.sleep(0.3)
        run_sequence(cache, [9, 9, 9, 9, 9])
        check(cache, pub, mirror)  # and from now on live
        assert mirror.replayed == 6 and mirror.next_seq == 7
        mirror.close()
    finally:
        pub.close()


def test_replay_buffer_keeps_only_the_last_buffer_steps():
    port = free_port()
    cache, pub = make_cache(port, buffer_steps=2)
    try:
        for i in range(5):
            run_sequence(cache, [i] * 4)
            cache.events.flush()
        assert pub.drain()
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{port + 1}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            assert dealer.poll(5000)
            _, seq, payload = dealer.recv_multipart()
            seqs.append(int.from_bytes(seq, "big", signed=True))
            if seqs[-1] == -1:
                break
        assert seqs == [3, 4, -1]  # a joiner sees it starts past 0: its view cannot be complete
        dealer.close(linger=0)
    finally:
        pub.close()


def test_a_full_queue_resyncs_with_a_snapshot():
    port = free_port()
    cache, pub = make_cache(port)
    mirror = Mirror(port)
    try:
        run_sequence(cache, list(range(12)))
        check(cache, pub, mirror)
        real, refusals = pub.try_publish, [3]

        def full_queue(events):
            if refusals[0]:
                refusals[0] -= 1
                pub.dropped_batches += 1
                return False
            return real(events)

        pub.try_publish = full_queue
        for tokens in ([0, 1, 2, 3, 7, 7, 7, 7], [5] * 9, list(range(12)) + [1] * 8):
            run_sequence(cache, tokens)
            cache.events.flush()  # dropped: the subscriber misses these steps
        cache.evict(2)
        check(cache, pub, mirror)
        assert pub.dropped_batches == 3 and not cache.events.out_of_sync
        assert "AllBlocksCleared" in mirror.tags  # the resync: cleared, then the whole tree
    finally:
        mirror.close()
        pub.close()


def test_no_events_means_no_hashes():
    cache = RadixCache(PagePool(8, 4))
    run_sequence(cache, list(range(8)))
    assert cache.events is None and all(n.hashes is None for n in cache._nodes())


# ---- an engine with a tiny model ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_checkpoint("llama3", tmp_path_factory.mktemp("kvev"))


def test_engine_publishes_one_batch_a_step_under_memory_pressure(tiny_llama, monkeypatch):
    from jaxserve import LLM, SamplingParams

    monkeypatch.setenv("PYTHONHASHSEED", SEED)
    port = free_port()
    llm = LLM(model=str(tiny_llama), **small_engine_options(num_pages=14, max_model_len=96, max_num_seqs=4,
                                                            kv_events_config=kv_events_json(port)))
    engine = llm.engine
    mirror = Mirror(port)
    pub = engine.prefix_cache.events.publisher
    steps, step = [0], engine.step

    def counted_step():
        steps[0] += 1
        return step()

    engine.step = counted_step
    try:
        rng = random.Random(1)
        system = [rng.randrange(3, 256) for _ in range(20)]
        prompts = [system + [rng.randrange(3, 256) for _ in range(rng.randrange(5, 30))] for _ in range(10)]
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        for start in range(0, len(prompts), 4):
            llm.generate(prompts[start: start + 4], params, use_tqdm=False)
            assert pub.drain()
            mirror.pump()
            engine.check_invariants()
            assert mirror.hashes == engine.prefix_cache.block_hashes()
        assert engine.prefix_cache.evicted_pages > 0 and "BlockRemoved" in mirror.tags
        assert 0 < pub.published_batches <= steps[0]  # at most one batch a step
        # Stored blocks hold prompt (and output) tokens, 16 to a block, chained from the prompt start.
        first = [b for b in mirror.blocks.values() if b[0] is None]
        assert all(len(t) == 16 for _, t in mirror.blocks.values()) and first
        engine.prefix_cache.reset()
        engine.step()  # no work: the step still hands the reset's events over
        assert pub.drain()
        mirror.pump()
        assert mirror.tags[-1] == "AllBlocksCleared" and mirror.hashes == set()
        engine.check_invariants()
    finally:
        mirror.close()
        engine.close()
    assert engine.prefix_cache.events.publisher is None


def _dp_worker(model: str, port: int) -> None:
    """In a process with 2 CPU devices: a 2x1 mesh (two replicas, two caches, two publishers)."""
    import sys

    from jaxserve import LLM, SamplingParams

    # Replica r publishes on port + r and replays on port + 10 + r (ports apart by more than the
    # replica count, or replica 1's PUB port would be replica 0's replay port).
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{port + 10}"}
    llm = LLM(model=model, **small_engine_options(mesh="2x1", num_pages=24, max_model_len=96,
                                                  kv_events_config=json.dumps(events)))
    print("ready", flush=True)
    sys.stdin.readline()  # the subscribers are connected
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(20, 60))] for _ in range(8)]
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for r in llm.engine.replicas:
        assert r.prefix_cache.events.publisher.drain()
    llm.engine.check_invariants()
    print(json.dumps([sorted(r.prefix_cache.block_hashes()) for r in llm.engine.replicas]), flush=True)
    sys.stdin.readline()  # the subscribers have compared
    llm.engine.close()


@pytest.mark.slow
def test_data_parallel_replicas_publish_separately(tiny_llama):
    import os
    import subprocess
    import sys
    from pathlib import Path

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHONHASHSEED=SEED)
    tests = Path(__file__).parent
    code = f"import test_kv_events as t; t._dp_worker({str(tiny_llama)!r}, {port})"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tests, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    mirrors = []
    try:
        assert proc.stdout.readline().strip() == "ready"
        mirrors = [Mirror(port + r, replay_port=port + 10 + r) for r in range(2)]
        proc.stdin.write("go\n")
        proc.stdin.flush()
        expected = json.loads(proc.stdout.readline())
        for rank, (mirror, hashes) in enumerate(zip(mirrors, expected)):
            mirror.pump()
            assert mirror.ranks == {rank} and mirror.hashes == set(hashes) and hashes
        assert not set(expected[0]) & set(expected[1])  # distinct prompts: no block in both caches
        proc.stdin.write("done\n")
        proc.stdin.flush()
        assert proc.wait(60) == 0
    finally:
        for m in mirrors:
            m.close()
        if proc.poll() is None:
            proc.kill()


def test_engine_without_events_has_no_recorder(tiny_llama):
    from jaxserve import LLM

    llm = LLM(model=str(tiny_llama), **small_engine_options(num_pages=16))
    assert llm.engine.prefix_cache.events is None


# ---- a real server -----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_server_publishes_kv_events_and_closes_on_sigterm(tmp_path_factory, monkeypatch):
    from server_utils import make_full_vocab_tiny, request, start_server

    from jaxserve.loading import load_tokenizer

    monkeypatch.setenv("PYTHONHASHSEED", SEED)  # the server process inherits it
    model = make_full_vocab_tiny(tmp_path_factory.mktemp("kvsrv"))
    port = free_port()
    server = start_server(model, tmp_path_factory.mktemp("kvxla"), "--kv-events-config", kv_events_json(port, topic="kv@"))
    mirror = Mirror(port, topic=b"kv@")
    try:
        prompt = "The quick brown fox jumps over the lazy dog. " * 6
        status, _, body = request("POST", server["base"] + "/v1/completions",
                                  {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert status == 200, body
        deadline = time.time() + 10
        while not mirror.blocks and time.time() < deadline:
            mirror.pump()
        ids = load_tokenizer(str(model))(prompt).input_ids
        stored = [t for _, t in sorted(mirror.blocks.values(), key=lambda b: b[0] is not None)]
        assert stored and stored[0] == tuple(ids[:16])  # the prompt's first page, hashed from the seed
        server["proc"].send_signal(signal.SIGTERM)
        assert server["proc"].wait(60) == 0
    finally:
        mirror.close()
        if server["proc"].poll() is None:
            server["proc"].kill()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_vllm_router_kv_aware_sends_each_prefix_to_the_server_that_cached_it(tmp_path_factory):
    """Two jaxserve servers behind `vllm-router --policy kv_aware`: each caches one prompt (sent to
    it directly); through the router, continuations of each prompt reach the server holding it
    (their usage shows the cached prefix). Random routing would pass 1 time in 16."""
    import re

    from server_utils import exercise_through_router, make_full_vocab_tiny, request, start_server, start_vllm_router

    model = make_full_vocab_tiny(tmp_path_factory.mktemp("kvrouter"))
    xla = tmp_path_factory.mktemp("kvrouterxla")
    ports = [free_port(), free_port()]
    servers = [start_server(model, xla, "--kv-events-config", kv_events_json(p)) for p in ports]
    log_path = xla / "router.log"
    args = ["--policy", "kv_aware", "--kv-event-block-size", "16", "--kv-event-model", "tiny", "--log-level", "debug",
            "--worker-urls", *[s["base"] for s in servers]]
    for s, p in zip(servers, ports):
        args += ["--kv-event-source", f"{s['base']}=tcp://127.0.0.1:{p}",
                 "--kv-event-replay-source", f"{s['base']}=tcp://127.0.0.1:{p + 1}"]
    router, base = start_vllm_router(args, log_path)
    try:
        rng = random.Random(3)
        prompts = [[rng.randrange(100, 40000) for _ in range(40)] for _ in servers]  # 2 full pages each

        def complete(url: str, prompt: list[int]) -> int:
            status, _, body = request("POST", url + "/v1/completions",
                                      {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
            assert status == 200, body
            return json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]

        for s, prompt in zip(servers, prompts):
            assert complete(s["base"], prompt) == 0
        time.sleep(2)  # the events reach the router
        for rep in range(2):
            for prompt in prompts:
                assert complete(base, prompt + [7 + rep] * 5) == 32  # only the server that has it can hit
        exercise_through_router(base)  # completions, a streamed chat, the openai client
        text = re.sub(r"\x1b\[[0-9;]*m", "", log_path.read_text())
        assert "tagged map" not in text
        assert len(re.findall(r"credited_prefix_tokens=32", text)) >= 4, text[-3000:]
    finally:
        router.kill()
        router.wait()
        for s in servers:
            s["proc"].kill()
            s["proc"].wait()
