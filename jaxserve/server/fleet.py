"""What routers and orchestrators ask a replica, beyond the OpenAI API: its version, what it
serves (SGLang's /model_info and /server_info, which sglang-router reads to register a worker
under its model name), its load (SGLang's /get_load), and the client's X-Request-Id.

The field names are SGLang's and vLLM's, so that their routers read them unchanged; the values
are ours. Which consumer reads what is listed in docs/fleet.md.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

from jaxserve.server.common import InvalidRequest

REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_CHARS = 256


def server_version() -> str:
    try:
        return importlib.metadata.version("jaxserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def request_id_from(headers: Any) -> str | None:
    """The client's X-Request-Id, or None. It becomes the request's label (the engine keeps its
    own server ids), so it must be printable ASCII without spaces and at most 256 characters."""
    value = headers.get(REQUEST_ID_HEADER)
    if value is None:
        return None
    if not value or len(value) > MAX_REQUEST_ID_CHARS or not all(33 <= ord(c) < 127 for c in value):
        raise InvalidRequest(f"{REQUEST_ID_HEADER} must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters "
                             "without spaces", "request_id")
    return value


def model_path_of(engine: Any) -> Path:
    from jaxserve.loading import default_model_path

    model = engine.engine.config.model
    return Path(model) if model else default_model_path()


def model_info(engine: Any, model_name: str) -> dict[str, Any]:
    """SGLang's /model_info fields. tokenizer_path: the checkpoint directory when it holds a
    tokenizer; for a GGUF file the file itself (its tokenizer is rebuilt from the metadata), and
    model_format says which."""
    e = engine.engine
    path = model_path_of(engine)
    gguf = path.suffix == ".gguf"
    has_tokenizer = path.is_dir() and any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    cfg = e.model_config
    hf = _hf_config(path)
    return {
        "model_path": str(path),
        "tokenizer_path": str(path) if gguf or has_tokenizer else None,
        "served_model_name": model_name,
        "model_format": "gguf" if gguf else "hf",
        "is_generation": True,
        "model_type": hf.get("model_type"),
        "architectures": hf.get("architectures"),
        "max_context_length": e.max_model_len,
        "vocab_size": cfg.vocab_size,
        "eos_token_ids": list(e.eos_token_ids),
        "preferred_sampling_params": None,
        "weight_version": "default",
    }


def _hf_config(path: Path) -> dict[str, Any]:
    """The checkpoint's config.json (model_type, architectures); {} for a GGUF file."""
    try:
        return json.loads((path / "config.json").read_text()) if path.is_dir() else {}
    except (OSError, ValueError):
        return {}


def server_info(engine: Any, model_name: str) -> dict[str, Any]:
    """SGLang's /server_info fields (its server arguments, flattened, plus the live state)."""
    from jaxserve.parallel import parse_mesh  # late: jax, which the front end alone does not need

    e = engine.engine
    c = e.config
    replicas = len(e.replicas)
    info = model_info(engine, model_name)
    dp, tp = parse_mesh(c.mesh)
    return {
        "model_path": info["model_path"],
        "tokenizer_path": info["tokenizer_path"],
        "served_model_name": model_name,
        "version": server_version(),
        "is_embedding": False,
        "tp_size": tp,
        "dp_size": dp,
        "load_balance_method": "round_robin" if replicas == 1 else "shortest_queue",
        "disaggregation_mode": "null",
        "context_length": e.max_model_len,
        "max_total_num_tokens": (e.num_pages - 1) * e.pool.page_size * replicas,
        "max_running_requests": c.max_num_seqs * replicas,
        "max_prefill_tokens": c.max_num_batched_tokens,
        "max_req_input_len": e.max_model_len - 1,
        "page_size": e.pool.page_size,
        "block_size": e.pool.page_size,  # vllm-router's kv_aware policy reads the KV block size under this name
        "kv_block_size": e.pool.page_size,
        "dtype": c.dtype,
        "enable_prefix_caching": bool(c.enable_prefix_caching),
        "disable_radix_cache": not c.enable_prefix_caching,
        "internal_states": [{"num_running_reqs": e.num_running, "num_waiting_reqs": e.num_waiting}],
    }


def load(engine: Any) -> list[dict[str, Any]]:
    """SGLang's /get_load: one entry per data-parallel replica; num_tokens is the KV tokens its
    requests hold (pages held by requests, not the evictable prefix-cache pages)."""
    out = []
    for r in engine.engine.replicas:
        held = r.pool.num_pages - 1 - r.pool.num_free
        try:  # read while the engine thread runs: a tree changing under the walk reads as no cache
            evictable = r.prefix_cache.evictable_pages() if r.prefix_cache is not None else 0
        except RuntimeError:
            evictable = 0
        out.append({"dp_rank": r.index, "num_reqs": len(r.scheduler.running) + len(r.scheduler.waiting),
                    "num_waiting_reqs": len(r.scheduler.waiting),
                    "num_tokens": max(0, held - evictable) * r.pool.page_size})
    return out
