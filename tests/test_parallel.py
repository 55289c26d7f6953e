"""Tensor and data parallelism on 8 simulated CPU devices, each scenario in one subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxserve import parallel
from jaxserve.models.llama import ModelConfig

WORKER = Path(__file__).with_name("mesh_worker.py")
MESHES = ["1x1", "1x2", "1x4", "2x2", "1x8"]


def worker_env() -> dict[str, str]:
    """The workers set their own device count; CPU only, whatever this machine has."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run_worker(model: str, meshes: list[str], tmp_path: Path) -> dict:
    out = tmp_path / "mesh.json"
    proc = subprocess.run([sys.executable, str(WORKER), model, str(out), *meshes], env=worker_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def check_equal_to_1x1(results: dict, meshes: list[str] = MESHES[1:]) -> None:
    base = results["meshes"]["1x1"]
    for mesh in meshes:
        r = results["meshes"][mesh]
        assert "error" not in r, r
        assert r["tokens"] == base["tokens"], mesh
        for seq_r, seq_b in zip(r["logprobs"], base["logprobs"]):
            for lp_r, lp_b in zip(seq_r, seq_b):
                common = set(lp_r) & set(lp_b)
                assert len(common) >= 4, (mesh, lp_r, lp_b)
                np.testing.assert_allclose([lp_r[k] for k in common], [lp_b[k] for k in common], atol=2e-4,
                                           err_msg=mesh)
        assert all(r["shardings_ok"].values()), (mesh, r["shardings_ok"])
        data, model = parallel.parse_mesh(mesh)
        assert len(r["replica_devices"]) == data and all(len(d) == model for d in r["replica_devices"])
        assert len({d for ds in r["replica_devices"] for d in ds}) == data * model  # replicas share no device
        assert all(n > 0 for n in r["requests_per_replica"]), r["requests_per_replica"]  # every replica served


@pytest.fixture(scope="module")
def default_results(tmp_path_factory) -> dict:
    return run_worker("default", MESHES, tmp_path_factory.mktemp("mesh_default"))


@pytest.fixture(scope="module")
def qwen3_results(tiny_checkpoints, tmp_path_factory) -> dict:
    return run_worker(str(tiny_checkpoints["qwen3"]), MESHES + ["1x3", "4x4"], tmp_path_factory.mktemp("mesh_qwen3"))


def test_default_model_meshes_match_1x1(default_results):
    check_equal_to_1x1(default_results)
    # SmolLM2's 9 query / 3 KV heads are re-laid so every shard holds whole heads.
    assert default_results["meshes"]["1x4"]["model_heads"] == [9, 3]
    assert default_results["meshes"]["1x4"]["served_heads"] == [12, 4]  # 3 query heads, 1 KV head per device
    assert default_results["meshes"]["1x2"]["served_heads"] == [12, 4]
    assert default_results["meshes"]["1x8"]["served_heads"] == [16, 8]  # KV heads repeated twice


def test_tiny_qwen3_meshes_match_1x1(qwen3_results):
    check_equal_to_1x1(qwen3_results)
    assert qwen3_results["meshes"]["1x2"]["served_heads"] == [4, 2]  # divisible: no re-layout


@pytest.mark.parametrize("arch", ["qwen2", "mistral_swa"])
def test_biases_and_sliding_window_on_a_mesh(arch, tiny_checkpoints, tmp_path):
    """Qwen2's q/k/v biases are split with their columns; Mistral's 16-token window holds per shard
    (the 40-token prompt reaches past it)."""
    results = run_worker(str(tiny_checkpoints[arch]), ["1x1", "1x2", "2x2"], tmp_path)
    check_equal_to_1x1(results, ["1x2", "2x2"])


def per_device(r: dict, key: str) -> list[int]:
    return sorted(r[key].values())


def test_per_device_bytes_shrink_with_the_model_axis(default_results, qwen3_results):
    for results in (default_results, qwen3_results):
        total = results["meshes"]["1x1"]["total_param_bytes"]
        for mesh in ("1x2", "1x4", "1x8"):
            t = parallel.parse_mesh(mesh)[1]
            r = results["meshes"][mesh]
            devices = per_device(r, "param_bytes_per_device")
            assert len(devices) == t and max(devices) == min(devices)
            assert sum(devices) >= total  # norms are replicated, nothing is lost
            # Only norms (and, for head counts T does not divide, padded heads) are not split.
            assert max(devices) < total / t * 1.5 or mesh == "1x8", (mesh, max(devices), total / t)
            kv = per_device(r, "kv_bytes_per_device")
            assert len(kv) == t and max(kv) == min(kv)
    # Divisible heads: exactly 1/T apart from the replicated norms.
    q = qwen3_results["meshes"]
    assert per_device(q["1x2"], "param_bytes_per_device")[0] < q["1x1"]["total_param_bytes"] / 2 * 1.05


def test_bad_meshes_are_clear_errors(qwen3_results):
    assert "needs 16 devices" in qwen3_results["meshes"]["4x4"]["error"]
    assert "intermediate_size=128 is not divisible by 3" in qwen3_results["meshes"]["1x3"]["error"]


def test_orbax_restores_sharded_weights_into_another_mesh(default_results):
    assert default_results["orbax"] == {"equal": True, "placed": True}


def cfg_with(heads: int, kv_heads: int) -> ModelConfig:
    return ModelConfig("llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=8)


@pytest.mark.parametrize("heads,kv_heads,tp", [(9, 3, 2), (9, 3, 4), (9, 3, 8), (4, 2, 8), (8, 8, 4), (4, 1, 4)])
def test_head_layout_keeps_every_shard_self_contained(heads, kv_heads, tp):
    layout = parallel.head_layout(cfg_with(heads, kv_heads), tp)
    q, kv = np.asarray(layout.q_heads), np.asarray(layout.kv_heads)
    assert len(kv) % tp == 0 and len(q) % len(kv) == 0
    assert sorted(q[q >= 0].tolist()) == list(range(heads))  # every query head served once
    assert sorted(set(kv[kv >= 0].tolist())) == list(range(kv_heads))
    group, served_group = heads // kv_heads, len(q) // len(kv)
    for i, h in enumerate(q):  # served q head i reads served KV head i // served_group
        if h >= 0:
            assert kv[i // served_group] == h // group
    # Never more query heads per device than an even split of the KV groups needs.
    assert len(q) // tp <= -(-kv_heads // tp) * group
    assert parallel.head_layout(cfg_with(heads, kv_heads), 1).is_identity


def test_apply_head_layout_zero_pads_and_repeats():
    cfg = cfg_with(9, 3)
    rng = np.random.default_rng(0)
    from jaxserve.models.llama import param_shapes

    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in param_shapes(cfg).items()}
    layout = parallel.head_layout(cfg, 8)
    served, out = parallel.apply_head_layout(cfg, params, layout)
    assert (served.num_heads, served.num_kv_heads) == (16, 8)
    D = cfg.head_dim
    for i, h in enumerate(layout.q_heads):
        col = out["wq"][:, :, i * D:(i + 1) * D]
        np.testing.assert_array_equal(col, 0 if h < 0 else params["wq"][:, :, h * D:(h + 1) * D])
        np.testing.assert_array_equal(out["wo"][:, i * D:(i + 1) * D], 0 if h < 0 else params["wo"][:, h * D:(h + 1) * D])
    for j, h in enumerate(layout.kv_heads):
        want = 0 if h < 0 else params["wk"][:, :, h * D:(h + 1) * D]
        np.testing.assert_array_equal(out["wk"][:, :, j * D:(j + 1) * D], want)
    assert -1 in layout.kv_heads and -1 in layout.q_heads  # 9/3 heads over 8: zero heads pad both


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MULTIHOST_MESHES = ["1x4", "2x2", "1x1"]


def run_two_processes(tmp_path: Path) -> tuple[list[int], list[str]]:
    worker = Path(__file__).with_name("multihost_worker.py")
    port = str(free_port())
    logs = [tmp_path / f"process{i}.log" for i in (0, 1)]
    procs = []
    for i in (1, 0):  # output to files: neither process can block on a full pipe
        with open(logs[i], "w") as log:
            procs.append(subprocess.Popen([sys.executable, str(worker), str(i), port, str(tmp_path),
                                           *MULTIHOST_MESHES], env=worker_env(), stdout=log,
                                          stderr=subprocess.STDOUT))
    follower, leader = procs
    try:
        leader.wait(timeout=600)
        if leader.returncode:  # the follower would wait minutes for a coordinator that is gone
            follower.kill()
        follower.wait(timeout=120)
    finally:
        for p in procs:
            p.kill()
    return [leader.returncode, follower.returncode], [log.read_text() for log in logs]


def test_two_processes_share_one_mesh(default_results, tmp_path):
    """jax.distributed over two localhost processes (gloo CPU collectives), 2 CPU devices each,
    process 0 scheduling and broadcasting each step: a 1x4 mesh over both; a 2x2 mesh whose second
    replica lives on process 1 alone (its sampled ids come back to the leader); a 1x1 mesh the
    follower holds no device of. Greedy tokens equal to the single-process 1x1 run."""
    codes, logs = run_two_processes(tmp_path)
    if any(codes) and any("Failed to add port" in log for log in logs):
        codes, logs = run_two_processes(tmp_path)  # the free port was taken before the coordinator bound it
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    leader = json.loads((tmp_path / "process0.json").read_text())
    follower = json.loads((tmp_path / "process1.json").read_text())
    assert leader["1x4"]["replica_processes"] == [[0, 0, 1, 1]]
    assert leader["2x2"]["replica_processes"] == [[0, 0], [1, 1]]
    assert leader["2x2"]["requests_per_replica"] == [2, 2]
    assert leader["1x1"]["replica_processes"] == [[0]]
    for mesh in MULTIHOST_MESHES:
        assert leader[mesh]["tokens"] == default_results["meshes"]["1x1"]["tokens"], mesh
        assert leader[mesh]["compiles_after_warmup"] == 0, mesh  # the broadcasts were compiled ahead too
        assert follower[mesh]["steps"] > 0, mesh
        assert follower[mesh]["compiles_after_warmup"] == 0, mesh


def test_server_refuses_a_mesh_the_devices_cannot_form():
    proc = subprocess.run([sys.executable, "-m", "jaxserve.serve", "--mesh", "2x4", "--grpc-port", str(free_port()),
                           "--http-port", str(free_port())], capture_output=True, text=True, timeout=120,
                          env=worker_env())
    assert proc.returncode == 2
    assert "cannot start: mesh '2x4' needs 8 devices, but only 1 CPU device(s) are visible" in proc.stderr


def start_multihost_servers(tmp_path: Path, name: str) -> tuple[list[subprocess.Popen], list[Path], int]:
    # Each start gets its own compilation cache: the early-SIGTERM start must still be loading.
    """`python -m jaxserve.serve` as leader and follower of a 1x4 mesh (2 CPU devices each)."""
    port, http_port = free_port(), free_port()
    env = {**worker_env(), "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    procs, logs = [], []
    for pid in (1, 0):
        log = tmp_path / f"{name}{pid}.log"
        with open(log, "w") as f:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "jaxserve.serve", "--mesh", "1x4", "--coordinator-address",
                 f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(pid),
                 "--grpc-port", str(free_port()), "--http-port", str(http_port), "--max-num-seqs", "4",
                 "--max-num-batched-tokens", "16", "--max-model-len", "128", "--num-pages", "32",
                 "--compilation-cache-dir", str(tmp_path / f"xla-{name}")], env=env, stdout=f,
                stderr=subprocess.STDOUT))
        logs.append(log)
    return procs[::-1], logs[::-1], http_port  # [leader, follower]


def test_multihost_server_serves_and_both_processes_stop_on_sigterm(default_results, tmp_path):
    import signal
    import time
    import urllib.request

    from jaxserve.loading import load_tokenizer

    (leader, follower), logs, http_port = start_multihost_servers(tmp_path, "serve")
    base = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.time() + 300
        while True:
            assert leader.poll() is None and follower.poll() is None, logs[0].read_text()[-3000:]
            assert time.time() < deadline, "the leader did not become healthy"
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        prompt = [1, 54, 198, 214, 72, 30]  # mesh_worker.PROMPTS[0]
        body = json.dumps({"prompt": prompt, "max_tokens": 10, "temperature": 0.0, "ignore_eos": True}).encode()
        req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            reply = json.loads(r.read())
        want = load_tokenizer(None).decode(default_results["meshes"]["1x1"]["tokens"][0], skip_special_tokens=True)
        assert reply["choices"][0]["text"] == want
        assert reply["usage"]["completion_tokens"] == 10
        leader.send_signal(signal.SIGTERM)
        assert leader.wait(timeout=120) == 0
        assert follower.wait(timeout=120) == 0, logs[1].read_text()[-3000:]  # released by the leader's STOP
        assert "leader stopped after" in logs[1].read_text()
    finally:
        leader.kill()
        follower.kill()

    # SIGTERM during start-up: the leader finishes loading, then stops the follower.
    (leader, follower), logs, _ = start_multihost_servers(tmp_path, "early")
    try:
        deadline = time.time() + 120
        # Right after jax.distributed starts, before the server's own handlers exist (a window
        # where jax's preemption handler used to swallow the signal).
        while "SIGTERM handler installed" not in logs[0].read_text():
            assert leader.poll() is None and time.time() < deadline, logs[0].read_text()[-3000:]
            time.sleep(0.1)
        leader.send_signal(signal.SIGTERM)
        assert leader.wait(timeout=300) == 0, logs[0].read_text()[-3000:]
        assert follower.wait(timeout=120) == 0, logs[1].read_text()[-3000:]
        assert "stop requested while loading" in logs[0].read_text()
    finally:
        leader.kill()
        follower.kill()


SETUP_CHECK = """
import sys
from types import SimpleNamespace
from jaxserve import distributed
distributed.initialize("127.0.0.1:" + sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
pages = int(sys.argv[3])
import jax
from jaxserve.parallel import make_mesh
runner = SimpleNamespace(buckets=SimpleNamespace(all=lambda: [(16, 8, 8)]), history_len=128, mesh=make_mesh("1x1"),
                         kv_shape=(30, pages, 16, 6, 64), model=SimpleNamespace(cfg="a model config"))
try:
    distributed.check_same_setup([runner])
except AssertionError as e:
    print("MISMATCH:", e)
    sys.exit(3)
print("SAME")
"""


@pytest.mark.parametrize("pages", [(48, 48), (48, 64)])
def test_processes_started_with_different_settings_are_an_error(pages, tmp_path):
    port = str(free_port())
    logs = [tmp_path / f"p{i}.log" for i in (0, 1)]
    procs = []
    for i in (1, 0):
        with open(logs[i], "w") as f:
            procs.append(subprocess.Popen([sys.executable, "-c", SETUP_CHECK, port, str(i), str(pages[i])],
                                          env=worker_env(), stdout=f, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    out = [log.read_text() for log in logs]
    if pages[0] == pages[1]:
        assert codes == [0, 0] and all("SAME" in o for o in out), out
    else:
        assert codes == [3, 3], out
        assert all("different engine settings" in o for o in out), out
