"""Where jaxserve caches what it builds: converted weights, tokenizers, CPU kernels, compiled steps.

A module of its own so that low-level packages (cpu_kernels) need not import the loaders.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$JAXSERVE_CACHE_DIR, default ~/.cache/jaxserve."""
    return Path(os.environ.get("JAXSERVE_CACHE_DIR", Path.home() / ".cache" / "jaxserve"))
