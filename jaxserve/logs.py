"""Logging for the command-line entry points: jaxserve's INFO lines, third-party chatter at WARNING.

On first start orbax and absl log every checkpoint step at INFO, and jax logs "Unable to
initialize backend 'tpu'" for each plugin it probes; none of it is actionable for a user.
Progress bars and log lines share stderr: a log record is written through ``tqdm.write`` so it
never lands in the middle of a bar, and where stderr is no terminal (a log file, CI) bars are off
and ``progress`` logs a start and an end line instead.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

# Loggers whose INFO/DEBUG lines describe their internals, not what jaxserve does.
QUIET = ("absl", "orbax", "jax", "jaxlib", "etils", "httpx", "urllib3", "grpc", "filelock",
         "transformers", "huggingface_hub")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _TqdmHandler(logging.StreamHandler):
    """A stderr handler that clears and redraws any active tqdm bar around each record."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # logging must never raise into the caller
            self.handleError(record)


def setup_logging(level: int | str = logging.INFO, quiet_level: int = logging.WARNING) -> None:
    """Configure the root logger once for a CLI process (idempotent)."""
    skip_absent_tpu()
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, _TqdmHandler):
            root.removeHandler(h)
    handler = _TqdmHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level)
    for name in QUIET:
        logging.getLogger(name).setLevel(quiet_level)
    try:  # absl routes through the "absl" logger unless its own handler is active; keep both quiet
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.WARNING)
    except ImportError:
        pass


def skip_absent_tpu() -> None:
    """On a host with libtpu installed but no TPU chip, jax still probes the TPU plugin, and libtpu
    prints a screen of C++ errors about metadata it cannot reach. Where the host has neither a TPU
    nor an NVIDIA GPU, CPU is the only backend anyway: select it up front (JAX_PLATFORMS wins)."""
    if os.environ.get("JAX_PLATFORMS") or importlib.util.find_spec("libtpu") is None:
        return
    try:
        from jax._src import hardware_utils  # private, hence the guard: a moved helper costs only noise

        if hardware_utils.num_available_tpu_chips_and_device_id()[0] or hardware_utils.has_visible_nvidia_gpu():
            return
        import jax

        jax.config.update("jax_platforms", "cpu")
    except Exception:
        return


def is_tty() -> bool:
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def progress(items: Iterable[T], desc: str, total: int | None = None, unit: str = "it",
             logger: logging.Logger | None = None, enabled: bool = True, **kw: Any) -> Iterator[T]:
    """A tqdm bar on a terminal; elsewhere one log line at the start and one at the end."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    if not enabled:
        yield from items
        return
    if is_tty():
        from tqdm import tqdm

        yield from tqdm(items, desc=desc, total=total, unit=unit, leave=False, **kw)
        return
    log = logger or logging.getLogger("jaxserve")
    log.info("%s: %s %s", desc, total if total is not None else "?", unit + "s")
    t0, n = time.monotonic(), 0
    for n, item in enumerate(items, 1):
        yield item
    log.info("%s: done, %d %s in %.1f s", desc, n, unit + "s", time.monotonic() - t0)
