"""Multi-host serving: one mesh over every process's devices, process 0 leading.

JAX runs one program per host (multi-controller): every process must launch the same step with
the same inputs. Process 0 alone serves the API and schedules; before each step it broadcasts a
header (which replicas run, in which bucket), then each active replica's padded inputs. The other
processes run ``follow(engine)``: receive, launch the same compiled steps, repeat until the leader
stops. A replica whose devices all belong to other processes sends its sampled ids back to the
leader (``gather_outputs``). Everything rides jax's own collectives (``multihost_utils``), gloo on
CPU. Every broadcast shape is compiled once at start-up (``warm_up``), so serving compiles nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Any, Sequence

import jax
import numpy as np

from jaxserve.engine.runner import host_zeros

log = logging.getLogger(__name__)

# Header kinds. IDLE is the leader's keep-alive: followers wait for the next header inside a
# collective, and XLA passes a timeout to every gloo operation (30 minutes in its source; not
# waited out here).
_STEP, _STOP, _IDLE = 1, 2, 3
KEEP_ALIVE_SECONDS = 60.0


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """jax.distributed.initialize from flags, else the environment (JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES, JAX_PROCESS_ID). With none of them set on a TPU pod slice, jax finds the
    topology itself. Call before any other jax use."""
    address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and os.environ.get("JAX_NUM_PROCESSES"):
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and os.environ.get("JAX_PROCESS_ID"):
        process_id = int(os.environ["JAX_PROCESS_ID"])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices only; harmless elsewhere
    jax.distributed.initialize(coordinator_address=address, num_processes=num_processes, process_id=process_id)
    log.info("process %d of %d; %d local / %d global devices", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())


def is_leader() -> bool:
    return jax.process_index() == 0


def _broadcast(tree: Any, is_source: bool | None = None) -> Any:
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(tree, is_source=is_source)


def _header(kind: int, num_replicas: int) -> np.ndarray:
    header = np.zeros(1 + 4 * num_replicas, np.int32)
    header[0] = kind
    return header


def _process_indices(mesh: Any) -> set[int]:
    return {d.process_index for d in mesh.devices.flat}


class StepBroadcaster:
    """Leader side: sends each step's plans (one per replica, None where idle) to the followers."""

    def __init__(self, num_replicas: int, keep_alive_seconds: float = KEEP_ALIVE_SECONDS):
        self.num_replicas = num_replicas
        self.keep_alive_seconds = keep_alive_seconds
        self.last_sent = time.monotonic()

    def send(self, runners: Sequence[Any], plans: Sequence[Any]) -> None:
        header = _header(_STEP, self.num_replicas)
        for i, plan in enumerate(plans):
            if plan is not None:
                header[1 + 4 * i: 5 + 4 * i] = (1, *plan.bucket)
        _broadcast(header)
        for runner, plan in zip(runners, plans):
            if plan is not None:  # one broadcast per replica: its shapes depend on its bucket only
                _broadcast(runner.step_inputs(plan))
        self.last_sent = time.monotonic()

    def keep_alive(self) -> bool:
        """Release the followers' wait if nothing was sent for keep_alive_seconds; returns whether sent."""
        if time.monotonic() - self.last_sent < self.keep_alive_seconds:
            return False
        _broadcast(_header(_IDLE, self.num_replicas))
        self.last_sent = time.monotonic()
        return True

    def stop(self) -> None:
        _broadcast(_header(_STOP, self.num_replicas))


def gather_outputs(runners: Sequence[Any], outs: Sequence[Any]) -> list[Any]:
    """Every process calls this after launching a step, with the same active replicas in the same
    order. Returns each replica's sampled outputs as host arrays on the leader (None on a follower
    for a replica it need not read). A replica that has devices on process 0 is read there; one that
    has none is sent to everyone by its first process."""
    me, fetched = jax.process_index(), []
    for runner, out in zip(runners, outs):
        owners = _process_indices(runner.mesh)
        if 0 in owners:
            fetched.append(runner.to_host(out) if me in owners else None)
        else:
            source = me == min(owners)
            fetched.append(_broadcast(runner.to_host(out) if source else host_zeros(out), is_source=source))
    return fetched


def check_same_setup(runners: Sequence[Any], settings: Sequence[Any] = ()) -> None:
    """Every process must build the same replicas, buckets and pool, or the broadcasts would wait
    forever for shapes the others never send: compare a digest of them (and of `settings`, such
    as the mesh and dtype) across processes."""
    from jax.experimental import multihost_utils

    r = runners[0]
    devices = [sorted(d.id for d in runner.mesh.devices.flat) for runner in runners]
    setup = repr((tuple(settings), devices, r.buckets.all(), r.history_len, r.kv_shape, r.model.cfg))
    digest = np.frombuffer(hashlib.sha256(setup.encode()).digest()[:16], np.int32)
    multihost_utils.assert_equal(digest, "the processes were started with different engine settings "
                                         "(check the mesh, dtype, budgets, pages and model): give every "
                                         "process the same flags")


def warm_up(runners: Sequence[Any]) -> None:
    """Compile every broadcast serving can send: the header, each bucket's inputs and, for replicas
    off process 0, each bucket's outputs. Every process calls it at the same point of start-up."""
    runner = runners[0]  # all replicas share the buckets
    _broadcast(_header(_STEP, len(runners)))
    for bucket in runner.buckets.all():
        _broadcast(runner.input_template(bucket))
    if any(0 not in _process_indices(r.mesh) for r in runners):
        for num_seqs in sorted({bucket[1] for bucket in runner.buckets.all()}):
            _broadcast(runner.output_template(num_seqs))


def follow(engine: Any) -> int:
    """Follower loop: run every step the leader broadcasts; returns the number of steps run."""
    runners = [r.runner for r in engine.replicas]
    steps = 0
    while True:
        header = np.asarray(_broadcast(_header(0, len(runners))))
        if header[0] == _STOP:
            return steps
        if header[0] == _IDLE:
            continue
        if header[0] != _STEP:
            raise RuntimeError(f"unknown step header {header[0]} from the leader")
        active = [(runner, tuple(int(x) for x in header[2 + 4 * i: 5 + 4 * i]))
                  for i, runner in enumerate(runners) if header[1 + 4 * i]]
        # Receive every replica's inputs before launching any, in the leader's order.
        inputs = [_broadcast(runner.input_template(bucket)) for runner, bucket in active]
        outs = [runner.launch_inputs(bucket, x) for (runner, bucket), x in zip(active, inputs)]
        gather_outputs([runner for runner, _ in active], outs)  # also keeps pace with the leader
        steps += 1
