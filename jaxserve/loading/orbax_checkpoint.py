"""Orbax save / restore of converted (stacked) weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp


def save_params(path: Path, params: dict[str, Any]) -> None:
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, params, force=True)
        ckptr.wait_until_finished()


def restore_params(path: Path, target: dict[str, Any] | None = None) -> dict[str, Any]:
    """Restore weights; with `target` (arrays or ShapeDtypeStructs carrying shardings) each array
    is restored straight into its placement."""
    path = Path(path).absolute()
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(path, target) if target is not None else ckptr.restore(path)
    return {k: (np.asarray(v) if target is None else v) for k, v in restored.items()}
