"""Interleaved timing: every variant once per round, so machine noise hits all of them alike."""
from __future__ import annotations

import time
from typing import Callable

import jax
import numpy as np


def interleaved(fns: dict[str, Callable[[], object]], rounds: int, warmup: int = 1
                ) -> dict[str, list[float]]:
  """Seconds per call of each zero-argument function, `rounds` samples each, interleaved."""
  for _ in range(warmup):
    for fn in fns.values():
      jax.block_until_ready(fn())
  samples = {name: [] for name in fns}
  for _ in range(rounds):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      samples[name].append(time.perf_counter() - start)
  return samples


def ratio_summary(samples: dict[str, list[float]], baseline: str) -> dict[str, dict]:
  """Per variant: median seconds, and median / spread (25th-75th pct) of the per-round ratio
  to `baseline` (ratios are taken within a round, then summarised)."""
  base = np.asarray(samples[baseline])
  out = {}
  for name, times in samples.items():
    ratio = np.asarray(times) / base
    out[name] = {"median_s": float(np.median(times)),
                 "ratio_median": float(np.median(ratio)),
                 "ratio_p25": float(np.percentile(ratio, 25)),
                 "ratio_p75": float(np.percentile(ratio, 75))}
  return out


def print_table(title: str, summary: dict[str, dict], baseline: str) -> None:
  print(f"\n{title}")
  print(f"| variant | median ms | ratio to {baseline} (median) | p25-p75 |")
  print("|---|---|---|---|")
  for name, s in summary.items():
    print(f"| {name} | {s['median_s'] * 1e3:.1f} | {s['ratio_median']:.2f} | "
          f"{s['ratio_p25']:.2f}-{s['ratio_p75']:.2f} |")
