"""Starting `jax.distributed` for `launch.train`: from flags, or from the cluster environment."""
from __future__ import annotations

from typing import Callable

import jax
from absl import app, logging


def initialize_distributed(coordinator: str | None, num_processes: int | None,
                           process_id: int | None, platforms: str,
                           initialize: Callable[..., None] = jax.distributed.initialize) -> None:
  """Starts `jax.distributed`: from the three flags when given (all or none); else, unless
  the run is on CPU (`platforms` = JAX_PLATFORMS), from the environment JAX detects (Cloud
  TPU VM metadata, SLURM, ...), staying a single process where it detects none."""
  given = [name for name, value in (("coordinator_address", coordinator),
                                    ("num_processes", num_processes),
                                    ("process_id", process_id)) if value is not None]
  if given and len(given) != 3:
    raise app.UsageError("multi-process runs need --coordinator_address, --num_processes and "
                         f"--process_id together; got only {', '.join('--' + g for g in given)}.")
  if given:
    if not 0 <= process_id < num_processes:
      raise app.UsageError(f"--process_id={process_id} must be in [0, {num_processes}).")
    initialize(coordinator, num_processes, process_id)
  elif platforms != "cpu":
    try:
      initialize()
    except ValueError as e:  # no cluster environment found: one process
      logging.info("jax.distributed not initialised (%s): running as a single process.", e)
