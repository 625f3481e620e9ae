"""Recorded MoE traffic: routed rows per (step, MoE layer, device, expert) in WORKDIR/traffic/.

Shapes: n recorded steps, `layers` MoE layers, `devices` batch shards in mesh order (the
flattened ('data', 'fsdp', 'expert') axes, expert fastest), E experts, P expert shards; every
P consecutive devices form one expert group. Per device T tokens and top-K, so each
`counts[s, l, d]` row sums to N = T * K.

Format: one file per `TrafficRecorder.append` call,
`traffic/traffic-<seq:06d>-<first step:09d>-<last step:09d>.npz` (`np.savez_compressed`,
written to a `.tmp` file and renamed, so a reader never sees half a file), holding

  steps              [n] int64        the steps, increasing
  counts             [n, layers, devices, E] int32
  factors            [n] float64      the ragged_buffer_factor in force at each step
  expert_shards      [] int64         P
  tokens_per_device  [] int64         T
  k                  [] int64         K

`seq` numbers the files in write order. A resumed run records again the steps after its
checkpoint; those replace the earlier copies, so on a step recorded twice the file with the
larger `seq` wins. The folder is bounded: after each write the oldest files are deleted while
the folder holds more than `max_bytes` (the newest file always stays).
"""
from __future__ import annotations

import os
import re
from typing import NamedTuple, Sequence

import numpy as np

FOLDER = "traffic"
_NAME = re.compile(r"traffic-(\d{6,})-\d{9,}-\d{9,}\.npz")
_META = ("expert_shards", "tokens_per_device", "k")


class Traffic(NamedTuple):
  """Every recorded step once, in step order."""
  steps: np.ndarray       # [n] int64, increasing.
  counts: np.ndarray      # [n, layers, devices, E] int32 rows each device routed to each expert.
  factors: np.ndarray     # [n] float64 ragged_buffer_factor in force at each step.
  expert_shards: int      # P: size of the 'expert' mesh axis when recorded.
  tokens_per_device: int  # T.
  k: int                  # K experts per token.


def _recorded(folder: str) -> list[tuple[int, str]]:
  """`(seq, path)` of the folder's traffic files in write order."""
  found = [(_NAME.fullmatch(name), name) for name in os.listdir(folder)]
  return sorted((int(m.group(1)), os.path.join(folder, name)) for m, name in found if m)


class TrafficRecorder:
  """Appends recorded steps to `workdir/traffic/`, one compressed file per call."""

  def __init__(self, workdir: str, *, expert_shards: int, tokens_per_device: int, k: int,
               max_bytes: int = 1 << 30):
    self.folder = os.path.join(workdir, FOLDER)
    self.meta = dict(expert_shards=expert_shards, tokens_per_device=tokens_per_device, k=k)
    self.max_bytes = max_bytes
    os.makedirs(self.folder, exist_ok=True)

  def append(self, steps: Sequence[int], counts: np.ndarray, factors: Sequence[float]) -> None:
    """Writes `counts [n, layers, devices, E]` of `steps [n]` under `factors [n]`."""
    steps = np.asarray(steps, np.int64)
    factors = np.asarray(factors, np.float64)
    counts = np.asarray(counts)
    shards = self.meta["expert_shards"]
    if counts.ndim != 4 or not np.issubdtype(counts.dtype, np.integer):
      raise ValueError(f"counts must be integer [n, layers, devices, E]; got {counts.dtype} "
                       f"{counts.shape}.")
    if not len(steps) == len(factors) == counts.shape[0] >= 1:
      raise ValueError(f"{len(steps)} steps, {len(factors)} factors and counts for "
                       f"{counts.shape[0]} steps: need the same number, at least one.")
    if np.any(np.diff(steps) <= 0):
      raise ValueError(f"steps must be increasing; got {steps.tolist()}.")
    if counts.shape[2] % shards or counts.shape[3] % shards:
      raise ValueError(f"expert_shards={shards} must divide the {counts.shape[2]} devices and "
                       f"the {counts.shape[3]} experts of counts {counts.shape}.")
    routed = self.meta["tokens_per_device"] * self.meta["k"]
    sums = counts.sum(axis=-1)
    if np.any(sums != routed):
      raise ValueError(f"each device routes tokens_per_device * k = {routed} rows a step and "
                       f"layer; counts sum to {sums.min()}..{sums.max()}.")
    recorded = _recorded(self.folder)
    seq = recorded[-1][0] + 1 if recorded else 0
    path = os.path.join(self.folder, f"traffic-{seq:06d}-{steps[0]:09d}-{steps[-1]:09d}.npz")
    with open(path + ".tmp", "wb") as f:
      np.savez_compressed(f, steps=steps, counts=counts.astype(np.int32), factors=factors,
                          **{name: np.int64(value) for name, value in self.meta.items()})
    os.replace(path + ".tmp", path)
    self._bound([*recorded, (seq, path)])

  def _bound(self, recorded: list[tuple[int, str]]) -> None:
    """Deletes the oldest files while the folder holds more than `max_bytes`."""
    sizes = [os.path.getsize(path) for _, path in recorded]
    total = sum(sizes)
    for (_, path), size in zip(recorded[:-1], sizes):
      if total <= self.max_bytes:
        break
      os.remove(path)
      total -= size


def read_traffic(workdir: str) -> Traffic:
  """Every step recorded in `workdir/traffic/`, the newest file's copy of a step recorded twice."""
  folder = os.path.join(workdir, FOLDER)
  recorded = _recorded(folder) if os.path.isdir(folder) else []
  if not recorded:
    raise ValueError(f"{folder} holds no recorded traffic: run `python -m launch.train "
                     f"--workdir={workdir}` (with config.moe.record_traffic=True, the default) "
                     "first.")
  parts = []
  for _, path in recorded:
    with np.load(path, allow_pickle=False) as f:
      parts.append({name: f[name] for name in f.files})
  meta, shape = _layout(parts[0])
  for (_, path), part in zip(recorded, parts):
    if _layout(part) != (meta, shape):
      raise ValueError(f"{path}: metadata {_layout(part)[0]} and counts [layers, devices, E] "
                       f"{_layout(part)[1]} differ from {recorded[0][1]}'s {meta} {shape}; "
                       "traffic of different configs cannot be mixed.")
  steps = np.concatenate([part["steps"] for part in parts])
  order = np.concatenate([np.full(len(part["steps"]), i) for i, part in enumerate(parts)])
  # Sort by step, newest file first among equal steps, then keep each step's first row.
  rows = np.lexsort((-order, steps))
  _, newest = np.unique(steps[rows], return_index=True)
  rows = rows[newest]
  return Traffic(steps=steps[rows],
                 counts=np.concatenate([part["counts"] for part in parts])[rows],
                 factors=np.concatenate([part["factors"] for part in parts])[rows],
                 **meta)


def _layout(part: dict) -> tuple[dict, tuple]:
  """What every file of one run shares: the metadata and counts' `(layers, devices, E)`."""
  return {name: int(part[name]) for name in _META}, part["counts"].shape[1:]
