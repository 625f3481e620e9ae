"""One comparison helper: per-leaf relative Frobenius error with a message that shows it."""
from __future__ import annotations

import jax
import numpy as np

# Per-leaf |a - b| / |b| tolerances by dtype (docs/testing.md).
TOLERANCE = {np.dtype("float32"): 1e-5, np.dtype("bfloat16"): 2e-2}


def relative_error(actual, expected) -> float:
  a = np.asarray(actual, np.float64)
  b = np.asarray(expected, np.float64)
  denom = np.linalg.norm(b)
  return float(np.linalg.norm(a - b) / (denom if denom > 0 else 1.0))


def assert_trees_close(actual, expected, rtol: float | None = None, what: str = "") -> None:
  """Asserts every leaf pair is within `rtol` (default: by the expected leaf's dtype)."""
  paths_a = jax.tree_util.tree_flatten_with_path(actual)[0]
  leaves_b, tree_b = jax.tree.flatten(expected)
  assert jax.tree.structure(actual) == tree_b, f"{what}: tree structures differ"
  bad = []
  for (path, a), b in zip(paths_a, leaves_b):
    tol = rtol if rtol is not None else TOLERANCE[np.dtype(b.dtype)]
    where = f"{what}{jax.tree_util.keystr(path)}"
    assert np.shape(a) == np.shape(b), f"{where}: shape {np.shape(a)} != {np.shape(b)}"
    err = relative_error(a, b)
    if not err <= tol:
      bad.append(f"{what}{jax.tree_util.keystr(path)}: relative error {err:.3g} > {tol:.1g}")
  assert not bad, "\n".join(bad)
