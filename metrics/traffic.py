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
  fallback_chunks    [n, layers] int32  chunks each MoE layer's fallback ran (0: none)
  seconds            [] float64       the interval's wall time, from the previous fetch of the
                                      steps' outputs to this one; NaN when it is not a clean
                                      measurement (the first interval compiles; an eval, a
                                      checkpoint, a program switch or a background compile
                                      fell in it)

One file is one fetch interval of the trainer. `fallback_chunks` and `seconds` (the timings:
`Traffic.timings`) are absent from files written before they were recorded; such files still
give their traffic, and arrays a reader does not know are ignored.

`seq` numbers the files in write order. A resumed run records again the steps after its
checkpoint; those replace the earlier copies, so on a step recorded twice the file with the
larger `seq` wins. The folder is bounded: after each write the oldest files are deleted while
the folder holds more than `max_bytes` (the newest file always stays).

A reader skips, with one warning line each, the files it cannot use: one that does not load
(truncated, not a zip, an array missing or of another dtype or rank than above) and one recorded
for another config than the newest readable file (other metadata or counts' `[layers, devices,
E]`).
"""
from __future__ import annotations

import math
import os
import re
import zipfile
import zlib
from typing import NamedTuple, Sequence

import numpy as np
from absl import logging

FOLDER = "traffic"
_NAME = re.compile(r"traffic-(\d{6,})-\d{9,}-\d{9,}\.npz")
_META = ("expert_shards", "tokens_per_device", "k")
# Each array of a file, as the module docstring lists it: (dtype, rank).
_FORMAT = {"steps": (np.int64, 1), "counts": (np.int32, 4), "factors": (np.float64, 1),
           **{name: (np.int64, 0) for name in _META}}
# The timings, in files written since they were recorded: (dtype, rank), as above.
_TIMING_FORMAT = {"fallback_chunks": (np.int32, 2), "seconds": (np.float64, 0)}


class Timings(NamedTuple):
  """The cleanly timed fetch intervals that ran one factor throughout, in write order."""
  factors: np.ndarray         # [m] float64 the ragged_buffer_factor in force.
  steps: np.ndarray           # [m] int64 steps in the interval.
  fallback_steps: np.ndarray  # [m] int64 of them, steps whose fallback ran in some layer.
  chunks: np.ndarray          # [m] int64 fallback chunks run, summed over steps and layers.
  seconds: np.ndarray         # [m] float64 wall time of the interval.


class Traffic(NamedTuple):
  """Every recorded step once, in step order."""
  steps: np.ndarray       # [n] int64, increasing.
  counts: np.ndarray      # [n, layers, devices, E] int32 rows each device routed to each expert.
  factors: np.ndarray     # [n] float64 ragged_buffer_factor in force at each step.
  expert_shards: int      # P: size of the 'expert' mesh axis when recorded.
  tokens_per_device: int  # T.
  k: int                  # K experts per token.
  skipped: tuple[str, ...] = ()  # Paths of the files not read (each logged why), in write order.
  timings: Timings | None = None  # The files' timed intervals (superseded copies included).


class _Unreadable(Exception):
  """A traffic file that cannot be used; the message says why in a few words."""


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

  def append(self, steps: Sequence[int], counts: np.ndarray, factors: Sequence[float],
             fallback_chunks: np.ndarray, seconds: float = math.nan) -> None:
    """Writes `counts [n, layers, devices, E]` and `fallback_chunks [n, layers]` of `steps [n]`
    under `factors [n]`, and the interval's wall time `seconds` (NaN: not timed)."""
    steps = np.asarray(steps, np.int64)
    factors = np.asarray(factors, np.float64)
    counts = np.asarray(counts)
    fallback_chunks = np.asarray(fallback_chunks)
    shards = self.meta["expert_shards"]
    if counts.ndim != 4 or not np.issubdtype(counts.dtype, np.integer):
      raise ValueError(f"counts must be integer [n, layers, devices, E]; got {counts.dtype} "
                       f"{counts.shape}.")
    if not len(steps) == len(factors) == counts.shape[0] >= 1:
      raise ValueError(f"{len(steps)} steps, {len(factors)} factors and counts for "
                       f"{counts.shape[0]} steps: need the same number, at least one.")
    if fallback_chunks.shape != counts.shape[:2]:
      raise ValueError(f"fallback_chunks {fallback_chunks.shape} must be [n, layers] = "
                       f"{counts.shape[:2]}.")
    if np.any(np.diff(steps) <= 0):
      raise ValueError(f"steps must be increasing; got {steps.tolist()}.")
    if counts.shape[2] % shards or counts.shape[3] % shards:
      raise ValueError(f"expert_shards={shards} must divide the {counts.shape[2]} devices and "
                       f"the {counts.shape[3]} experts of counts {counts.shape}.")
    # Tokens with non-finite router logits are routed nowhere: a device routes at most T * K.
    routed = self.meta["tokens_per_device"] * self.meta["k"]
    sums = counts.sum(axis=-1)
    if np.any(sums > routed) or np.any(counts < 0):
      raise ValueError(f"each device routes at most tokens_per_device * k = {routed} rows a "
                       f"step and layer; counts sum to {sums.min()}..{sums.max()}.")
    recorded = _recorded(self.folder)
    seq = recorded[-1][0] + 1 if recorded else 0
    path = os.path.join(self.folder, f"traffic-{seq:06d}-{steps[0]:09d}-{steps[-1]:09d}.npz")
    with open(path + ".tmp", "wb") as f:
      np.savez_compressed(f, steps=steps, counts=counts.astype(np.int32), factors=factors,
                          fallback_chunks=fallback_chunks.astype(np.int32),
                          seconds=np.float64(seconds),
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
  """Every step recorded in `workdir/traffic/`, the newest file's copy of a step recorded twice.

  Files that cannot be used (module docstring) are skipped, each with a warning, and named in
  `skipped`. ValueError when no file is left to read.
  """
  folder = os.path.join(workdir, FOLDER)
  paths = [path for _, path in _recorded(folder)] if os.path.isdir(folder) else []
  parts = _loaded(paths)
  if not parts:
    what = f"readable traffic ({_files(len(paths))} skipped)" if paths else "recorded traffic"
    raise ValueError(f"{folder} holds no {what}: run `python -m launch.train "
                     f"--workdir={workdir}` (with config.traffic.record=True, the default) "
                     "first.")
  parts = _same_config(parts)
  return _merged(list(parts.values()), skipped=tuple(p for p in paths if p not in parts))


def _files(n: int) -> str:
  """`n` files, in words."""
  return f"{n} file" if n == 1 else f"{n} files"


def _skip(path: str, reason: str) -> None:
  """Logs in one line that the traffic file at `path` is not read, and why."""
  logging.warning("Skipping traffic file %s: %s.", path, reason)


def _loaded(paths: Sequence[str]) -> dict[str, dict[str, np.ndarray]]:
  """`{path: arrays}` of the files that load, in the order given; the others are skipped."""
  parts = {}
  for path in paths:
    try:
      parts[path] = _load(path)
    except _Unreadable as e:
      _skip(path, str(e))
  return parts


def _load(path: str) -> dict[str, np.ndarray]:
  """The arrays of the file at `path`, checked; _Unreadable when it cannot be used."""
  try:
    part = _arrays(path)
  except (zipfile.BadZipFile, zlib.error, EOFError) as e:
    raise _Unreadable(f"truncated or corrupt zip ({e})") from None
  except ValueError:
    # numpy's words would advise allow_pickle=True: never right for a file of plain arrays.
    raise _Unreadable("an array is not a plain numeric .npy") from None
  except OSError as e:
    raise _Unreadable(f"cannot read it ({e.strerror or e})") from None
  _check(part)
  return part


def _arrays(path: str) -> dict[str, np.ndarray]:
  """The `_FORMAT` arrays of the zip at `path`, loaded without pickle."""
  with open(path, "rb") as f:
    # np.load would take other bytes for a .npy file or a pickle: neither is traffic.
    if f.read(4) != b"PK\x03\x04":
      raise _Unreadable("not a zip file")
    f.seek(0)
    with np.load(f, allow_pickle=False) as npz:
      missing = [name for name in _FORMAT if name not in npz.files]
      if missing:
        raise _Unreadable(f"no {', '.join(missing)} array")
      timed = all(name in npz.files for name in _TIMING_FORMAT)
      return {name: npz[name] for name in (*_FORMAT, *(_TIMING_FORMAT if timed else ()))}


def _check(part: dict[str, np.ndarray]) -> None:
  """Raises _Unreadable unless the arrays have `_FORMAT`'s dtypes and ranks, and n >= 1 steps."""
  for name, (dtype, rank) in {**_FORMAT, **_TIMING_FORMAT}.items():
    if name in part and (part[name].dtype != dtype or part[name].ndim != rank):
      raise _Unreadable(f"{name} is {part[name].dtype} {part[name].shape}, not "
                        f"{np.dtype(dtype)} of rank {rank}")
  lengths = [len(part[name]) for name in ("steps", "counts", "factors")]
  if not lengths[0] == lengths[1] == lengths[2] >= 1:
    raise _Unreadable("{} steps, counts of {} and {} factors: need the same number, at least "
                      "one".format(*lengths))
  if "fallback_chunks" in part and part["fallback_chunks"].shape != part["counts"].shape[:2]:
    raise _Unreadable(f"fallback_chunks {part['fallback_chunks'].shape} is not [n, layers] "
                      f"{part['counts'].shape[:2]}")


def _same_config(parts: dict[str, dict]) -> dict[str, dict]:
  """The parts recorded for the newest part's config, in order; the others are skipped."""
  newest = list(parts)[-1]
  want = _layout(parts[newest])
  kept = {}
  for path, part in parts.items():
    layout = _layout(part)
    if layout == want:
      kept[path] = part
    else:
      _skip(path, f"metadata {layout[0]} and counts [layers, devices, E] {layout[1]} differ from "
                  f"the newest file's {want[0]} {want[1]} ({os.path.basename(newest)})")
  return kept


def _merged(parts: list[dict], skipped: tuple[str, ...]) -> Traffic:
  """One Traffic of `parts` (write order, one config): each step once, from the newest part."""
  steps = np.concatenate([part["steps"] for part in parts])
  order = np.concatenate([np.full(len(part["steps"]), i) for i, part in enumerate(parts)])
  # Sort by step, newest file first among equal steps, then keep each step's first row.
  rows = np.lexsort((-order, steps))
  _, newest = np.unique(steps[rows], return_index=True)
  rows = rows[newest]
  return Traffic(steps=steps[rows],
                 counts=np.concatenate([part["counts"] for part in parts])[rows],
                 factors=np.concatenate([part["factors"] for part in parts])[rows],
                 **_layout(parts[0])[0], skipped=skipped, timings=_timings(parts))


def _timings(parts: list[dict]) -> Timings:
  """The parts' timed intervals: those with a finite `seconds` and one factor throughout."""
  rows = [(part["factors"][0], len(part["steps"]), int(np.sum(part["fallback_chunks"].max(1) > 0)),
           int(np.sum(part["fallback_chunks"])), float(part["seconds"]))
          for part in parts if "seconds" in part and np.isfinite(part["seconds"])
          and np.all(part["factors"] == part["factors"][0])]
  columns = list(zip(*rows)) if rows else [()] * 5
  dtypes = (np.float64, np.int64, np.int64, np.int64, np.float64)
  return Timings(*(np.asarray(column, dtype) for column, dtype in zip(columns, dtypes)))


def _layout(part: dict) -> tuple[dict, tuple]:
  """What every file of one run shares: the metadata and counts' `(layers, devices, E)`."""
  return {name: int(part[name]) for name in _META}, part["counts"].shape[1:]
