"""The Kubernetes manifests under deploy/: rendered as kustomize would, checked against the server
they run (every jaxserve flag parses with the real argument parser and makes a valid EngineConfig;
probes hit real endpoints on declared ports; Services select real pods and ports) and against
Kubernetes' own schemas (kubernetes-validate). The router's flags are checked against its --help."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from server_utils import router_bin

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
KUSTOMIZATIONS = sorted(p.parent.name for p in DEPLOY.glob("*/kustomization.yaml"))
K8S_VERSION = "1.31"
# What the LeaderWorkerSet controller injects into every pod of a group (sample values).
LWS_ENV = {"LWS_LEADER_ADDRESS": "jaxserve-tpu-0.jaxserve-tpu", "LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "1"}


def _json_pointer(doc: dict, path: str) -> tuple[object, str]:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]
    node = doc
    for p in parts[:-1]:
        node = node[int(p)] if isinstance(node, list) else node[p]
    return node, parts[-1]


def _apply_patch(doc: dict, ops: list[dict]) -> None:
    """The JSON 6902 operations these manifests use (add, replace)."""
    for op in ops:
        parent, key = _json_pointer(doc, op["path"])
        assert op["op"] in ("add", "replace"), op
        if isinstance(parent, list):
            if key == "-":
                parent.append(op["value"])
            elif op["op"] == "add":
                parent.insert(int(key), op["value"])
            else:
                parent[int(key)] = op["value"]
        else:
            assert op["op"] == "add" or key in parent, f"replace of a missing {op['path']}"
            parent[key] = op["value"]


def render(name: str) -> list[dict]:
    """A kustomization's documents: resources (files or directories) then patches. Any other
    kustomize feature fails here, so the renderer cannot silently drift from kustomize."""
    kdir = DEPLOY / name
    k = yaml.safe_load((kdir / "kustomization.yaml").read_text())
    assert set(k) <= {"apiVersion", "kind", "resources", "patches"}, set(k)
    docs: list[dict] = []
    for res in k["resources"]:
        path = (kdir / res).resolve()
        if path.is_dir():
            docs += render(str(path.relative_to(DEPLOY)))
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in k.get("patches", []):
        target = patch["target"]
        hits = [d for d in docs if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
        assert len(hits) == 1, target
        _apply_patch(hits[0], yaml.safe_load(patch["patch"]))
    return docs


def pod_templates(doc: dict) -> list[dict]:
    if doc["kind"] == "Deployment":
        return [doc["spec"]["template"]]
    if doc["kind"] == "LeaderWorkerSet":
        t = doc["spec"]["leaderWorkerTemplate"]
        return [t["leaderTemplate"], t["workerTemplate"]]
    return []


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


def loading_app():
    """The HTTP app as a pod has it while the model loads (no engine yet)."""
    from jaxserve.server.http_server import build_http_app
    from jaxserve.server.metrics import Metrics

    return build_http_app(lambda: None, Metrics(), "m")


def http_routes() -> set[str]:
    return {r.path for r in loading_app().routes}


def test_probe_endpoints_answer_as_probes_need():
    """Liveness (and start-up) must pass while the model loads (and drains); readiness must not."""
    from fastapi.testclient import TestClient

    client = TestClient(loading_app())
    probes = {}
    for name in KUSTOMIZATIONS:
        for doc in render(name):
            for t in pod_templates(doc):
                for c in t["spec"]["containers"]:
                    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                        if probe in c:
                            probes.setdefault(probe, set()).add(c[probe]["httpGet"]["path"])
    assert set(probes) == {"startupProbe", "readinessProbe", "livenessProbe"}, probes
    for path in probes["startupProbe"] | probes["livenessProbe"]:
        assert client.get(path).status_code == 200, path
    for path in probes["readinessProbe"]:
        assert client.get(path).status_code == 503, path


def test_every_kustomization_is_tested():
    assert {"replicas", "replicas-gpu", "router", "tpu-multihost"} <= set(KUSTOMIZATIONS), KUSTOMIZATIONS


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_manifests_match_the_server_and_kubernetes(name, monkeypatch):
    import kubernetes_validate

    from jaxserve.config import config_from_args
    from jaxserve.serve import parse_args

    docs = render(name)
    routes = http_routes()
    monkeypatch.chdir(ROOT)  # the image's working directory holds configs/ (deploy/Dockerfile)
    servers = 0
    for doc in docs:
        # Built-in kinds against Kubernetes' schema; a LeaderWorkerSet (a CRD) by its pod templates.
        if doc["kind"] != "LeaderWorkerSet":
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        for template in pod_templates(doc):
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": template["metadata"] | {"name": "p"},
                   "spec": template["spec"]}
            kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
            for c in template["spec"]["containers"]:
                if not c["image"].startswith("jaxserve"):
                    continue
                servers += 1
                argv = [expand(a, LWS_ENV) for a in c.get("args", [])]
                args = parse_args(argv)  # an unknown flag or a bad value exits here
                config_from_args(args)  # engine values checked (EngineConfig.__post_init__)
                ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
                if "http" in ports:  # the process serving the API (not a multi-host worker)
                    assert ports["http"] == args.http_port and ports.get("grpc") == args.grpc_port, (ports, argv)
                    assert args.host == "0.0.0.0", "a pod must listen beyond loopback"
                    grace = template["spec"].get("terminationGracePeriodSeconds", 30)
                    assert grace > args.grace_period, "the kubelet's SIGKILL would cut the drain short"
                if args.coordinator_address:
                    assert args.coordinator_address.endswith(f":{ports.get('coordinator', 8476)}")
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    if probe in c:
                        get = c[probe]["httpGet"]
                        assert get["path"] in routes, (probe, get["path"])
                        assert get["port"] in ports or get["port"] in ports.values(), (probe, get)
                if "http" in ports:  # the API process has all three probes
                    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(c), c
    # Services point at pods and ports that exist.
    for svc in (d for d in docs if d["kind"] == "Service"):
        sel = svc["spec"]["selector"]
        pods = [t for d in docs for t in pod_templates(d)
                if sel.items() <= t["metadata"].get("labels", {}).items()]
        assert pods, f"service {svc['metadata']['name']} selects no pod"
        for port in svc["spec"]["ports"]:
            names = {p["name"] for t in pods for c in t["spec"]["containers"] for p in c.get("ports", [])}
            assert port["targetPort"] in names, (svc["metadata"]["name"], port)
    if name != "router":
        assert servers, "no jaxserve container found"


def test_router_finds_the_replicas():
    """The router's discovery selector and port are the replicas' pod labels and HTTP port."""
    replicas = {d["kind"]: d for d in render("replicas")}["Deployment"]["spec"]["template"]
    router = {d["kind"]: d for d in render("router")}["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    args = dict(a.removeprefix("--").split("=", 1) if "=" in a else (a.removeprefix("--"), None)
                for a in router["args"])
    key, value = args["selector"].split("=")
    assert replicas["metadata"]["labels"][key] == value
    http = next(p["containerPort"] for p in replicas["spec"]["containers"][0]["ports"] if p["name"] == "http")
    assert int(args["service-discovery-port"]) == http
    assert args["health-check-endpoint"] in http_routes()


@pytest.mark.slow
def test_router_flags_exist_in_vllm_router():
    """Every flag of the router Deployment appears in `vllm-router --help` (its own venv: make routers)."""
    exe = router_bin(".venv-vllm-router", "vllm-router")
    help_text = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60).stdout
    router = {d["kind"]: d for d in render("router")}["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    for arg in router["args"]:
        flag = arg.split("=", 1)[0]
        assert re.search(rf"\[{re.escape(flag)}[\] ]", help_text), f"vllm-router has no {flag}"
