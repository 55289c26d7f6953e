"""Multi-host serving: one mesh over every process's devices, process 0 leading.

JAX runs one program per host (multi-controller): every process must launch the same step with
the same inputs. Process 0 alone serves the API and schedules; before each step it broadcasts the
step's plan (bucket shapes, then the padded arrays) to the other processes, which run
``follow(engine)``: receive, launch the same compiled step on their own devices, repeat until the
leader stops. The broadcast rides jax's own collectives (``multihost_utils``), gloo on CPU.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import jax
import numpy as np

log = logging.getLogger(__name__)

_STEP, _STOP = 1, 2


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


def _broadcast(tree: Any) -> Any:
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(tree)


class StepBroadcaster:
    """Leader side: sends each step's plans (one per replica, None where idle) to the followers."""

    def __init__(self, num_replicas: int):
        self.num_replicas = num_replicas

    def send(self, runners: Sequence[Any], plans: Sequence[Any]) -> None:
        header = np.zeros(1 + 4 * self.num_replicas, np.int32)
        header[0] = _STEP
        for i, plan in enumerate(plans):
            if plan is not None:
                header[1 + 4 * i: 5 + 4 * i] = (1, *plan.bucket)
        _broadcast(header)
        _broadcast([runner.step_inputs(plan) for runner, plan in zip(runners, plans) if plan is not None])

    def stop(self) -> None:
        header = np.zeros(1 + 4 * self.num_replicas, np.int32)
        header[0] = _STOP
        _broadcast(header)


def follow(engine: Any) -> int:
    """Follower loop: run every step the leader broadcasts; returns the number of steps run."""
    runners = [r.runner for r in engine.replicas]
    steps = 0
    while True:
        header = np.asarray(_broadcast(np.zeros(1 + 4 * len(runners), np.int32)))
        if header[0] == _STOP:
            return steps
        active = [(runner, tuple(int(x) for x in header[2 + 4 * i: 5 + 4 * i]))
                  for i, runner in enumerate(runners) if header[1 + 4 * i]]
        inputs = _broadcast([runner.input_template(bucket) for runner, bucket in active])
        outs = [runner.launch_inputs(bucket, jax.tree.map(np.asarray, x)) for (runner, bucket), x in zip(active, inputs)]
        for (runner, _), out in zip(active, outs):
            runner.fetch(out)  # keep pace with the leader
        steps += 1
