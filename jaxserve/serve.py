"""python -m jaxserve.serve: gRPC and OpenAI-compatible HTTP over one engine, in one process.

Both listeners come up at once (health NOT_SERVING, HTTP 503) while the model loads and every
step bucket compiles; then health turns SERVING. SIGTERM (or SIGINT) drains both front ends the
same way: readiness turns false (gRPC health NOT_SERVING, HTTP /health 503), new work gets
UNAVAILABLE / 503 with Retry-After, requests in flight finish, or get a final error when
--grace-period runs out; then the listeners close and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Iterator

from jaxserve.config import add_engine_args, config_from_args
from jaxserve.logs import is_tty, setup_logging

log = logging.getLogger("jaxserve.serve")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxserve.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require this key (HTTP Bearer, gRPC metadata)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate for gRPC TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key for gRPC TLS")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--grace-period", type=float, default=30.0, help="seconds running requests get on SIGTERM")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20)
    p.add_argument("--max-sequences-per-request", type=int, default=128,
                   help="cap on prompts x n in one HTTP request (so one request cannot fill the queue)")
    p.add_argument("--enable-debug-endpoints", action="store_true",
                   help="GET /debug/pages: page-pool invariants and counts (for tests)")
    p.add_argument("--tool-call-parser", default="auto", choices=("auto", "hermes", "llama3_json"),
                   help="how chat outputs are read for tool calls (auto: from the chat template)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--coordinator-address", default=None,
                   help="multi-host: host:port of process 0 (else $JAX_COORDINATOR_ADDRESS)")
    p.add_argument("--num-processes", type=int, default=None, help="multi-host: process count (else $JAX_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, default=None, help="multi-host: this process (else $JAX_PROCESS_ID)")
    add_engine_args(p)
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.server.grpc_server import GenerationService, build_grpc_server, set_health
    from jaxserve.server.http_server import build_http_app
    from jaxserve.server.metrics import Metrics

    config = config_from_args(args)
    model_name = args.served_model_name or (Path(config.model).stem if config.model else "SmolLM2-135M-Instruct")
    metrics = Metrics(model_name)
    holder: dict[str, AsyncEngine | None] = {"engine": None}
    get_engine = lambda: holder["engine"]  # noqa: E731

    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise SystemExit("--tls-cert and --tls-key go together")
        tls = (Path(args.tls_cert).read_bytes(), Path(args.tls_key).read_bytes())
    service = GenerationService(get_engine, metrics, args.api_key, args.max_request_bytes)
    grpc_server, health = build_grpc_server(service, f"{args.host}:{args.grpc_port}", tls)
    await set_health(health, False)
    await grpc_server.start()
    app = build_http_app(get_engine, metrics, model_name, args.api_key, args.max_request_bytes,
                         args.max_sequences_per_request, args.enable_debug_endpoints,
                         tool_call_parser=args.tool_call_parser)
    # By the time uvicorn is told to exit, the drain is over: the handlers only flush their last bytes.
    http = _http_server(uvicorn.Config(app, host=args.host, port=args.http_port, log_level="warning",
                                      access_log=False, lifespan="off", timeout_graceful_shutdown=5))
    http_task = asyncio.ensure_future(http.serve())

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if _early_signal:  # arrived before the handlers above (multi-host start-up)
        stop.set()
    log.info("listening: gRPC %s:%d%s, HTTP http://%s:%d (loading the model)", args.host, args.grpc_port,
             " (TLS)" if tls else "", args.host, args.http_port)

    def on_fatal(exc: BaseException) -> None:  # from the engine thread
        loop.call_soon_threadsafe(stop.set)

    t0 = time.perf_counter()
    load = loop.run_in_executor(None, lambda: AsyncEngine(config, on_fatal=on_fatal, show_progress=is_tty()))
    done, _ = await asyncio.wait([load, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    status = 0
    if load not in done:
        # Loading cannot be interrupted; wait for it so that the engine (and, multi-host, the
        # followers waiting for the first step) is shut down properly.
        log.info("stop requested while loading: shutting down once the model is loaded")
        await asyncio.wait([load])
    if load.exception() is not None:
        log.error("cannot start: %s", load.exception())
        status = 2
    elif load in done:
        engine = load.result()
        holder["engine"] = engine
        e = engine.engine
        log.info("ready in %.1f s: model %s, mesh %s, dtype %s, %d KV pages x %d (%.2f GiB), %d buckets compiled "
                 "in %.1f s", time.perf_counter() - t0, model_name, config.mesh, e.config.dtype, e.num_pages,
                 e.pool.page_size, e.runner.kv_cache_bytes / 2**30, len(e.buckets.all()), e.runner.compile_seconds)
        await set_health(health, True)
        await stop.wait()
        engine.accepting = False
        await set_health(health, False)
        if engine.fatal_error is not None:
            status = 1
        else:
            log.info("shutting down: no new requests; %d in flight get %.0f s", engine.num_in_flight,
                     args.grace_period)
            deadline = time.monotonic() + args.grace_period
            while engine.num_in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        await asyncio.to_thread(engine.shutdown)  # the step in progress may take a while
        if engine.fatal_error is not None:  # also what failed during the grace period or the STOP
            status = 1
    else:
        await asyncio.to_thread(load.result().shutdown)
    # The engine has ended every request (finished, or failed with a final error): give the
    # handlers a moment to send those last messages, then close both listeners.
    http.should_exit = True
    await asyncio.gather(grpc_server.stop(2.0), http_task)
    return status


def _http_server(config: "uvicorn.Config") -> "uvicorn.Server":  # noqa: F821 - uvicorn imports late
    import uvicorn

    class HttpServer(uvicorn.Server):
        """uvicorn without its own signal handling: uvicorn 0.55's serve() wraps itself in
        capture_signals(), which replaces our SIGTERM handler and closes the port at once (the
        install_signal_handlers hook of older versions is no longer called). We drain first."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

        def install_signal_handlers(self) -> None:  # uvicorn < 0.29
            return None

    return HttpServer(config)


def follow(args: argparse.Namespace) -> int:
    """Processes other than 0 of a multi-host mesh: no API, run the leader's steps until it stops."""
    from jaxserve import distributed
    from jaxserve.engine.engine import LLMEngine

    engine = LLMEngine(config_from_args(args), show_progress=False)
    log.info("following process 0")
    steps = distributed.follow(engine)
    log.info("leader stopped after %d steps", steps)
    return 0


_early_signal = False


def _exit_now(status: int) -> None:
    """Multi-host failure: exit at once. A normal exit would wait at jax.distributed's shutdown
    barrier (up to its 300 s default) for processes stuck in a collective. The coordination
    service then stops the others: at once when the leader, which hosts it, goes (seen here);
    after its heartbeat timeout (100 s default) when a follower goes."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level.upper())  # jaxserve's lines; absl/orbax/jax chatter held at WARNING
    if not (args.coordinator_address or args.num_processes or os.environ.get("JAX_COORDINATOR_ADDRESS")):
        return asyncio.run(serve(args))
    from jaxserve import distributed

    distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
    leader = distributed.is_leader()
    if leader:
        def remember(signum, frame):  # replaces jax.distributed's SIGTERM handler (a preemption notice)
            global _early_signal
            _early_signal = True

        signal.signal(signal.SIGTERM, remember)
        log.info("SIGTERM handler installed")
    try:
        status = asyncio.run(serve(args)) if leader else follow(args)
    except BaseException:  # SystemExit and KeyboardInterrupt too: never wait at the shutdown barrier
        log.exception("this multi-host process failed")
        _exit_now(1)
    if status != 0:
        _exit_now(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
