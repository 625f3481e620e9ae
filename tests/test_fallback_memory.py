"""Compiler-measured memory of the fallback (docs/design.md), on a CPU mesh and a v5p topology.

One layer where token buffers dominate (8 shards, top-2, 8 experts, 64 x 512 tokens, emb 1024,
MLP 2048, factor 2): a value-and-grad step with the fallback must stay within 1.10 x the capped
step, and below both the naive unrolled chunk loop and the worst-case buffer.
"""
import functools
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, require_libtpu

# One worker compiles each platform's variants once for all the module's tests
# (tests/conftest.py WORKER_GROUPS).

PLATFORMS = ["cpu", "tpu"]
# The library's modes: the fixed scan fallback, and adaptive chunking (a switch over the
# capped path and the rungs (8, 0.16 R), (8, 0.20 R), (8, R / 4)).
FALLBACKS = ["fallback_scan", "fallback_adaptive"]
VARIANTS = ("worst_case", "capped", "fallback_unrolled", *FALLBACKS)


# The TPU compiles run on one core: libtpu's compiler threads then use 14% less CPU (at 1.5x
# the wall time), and the suite, which keeps both cores busy, is bound by CPU
# (docs/testing.md). The child pins itself (a preexec_fn could deadlock a threaded parent).
_ONE_CORE = ("import os, runpy; os.sched_setaffinity(0, {max(os.sched_getaffinity(0))}); "
             "runpy.run_module('benchmarks.fallback_memory', run_name='__main__')")


@functools.lru_cache(maxsize=None)
def _mib(platform: str) -> dict:
  """MiB per device of each variant's step, from `python -m benchmarks.fallback_memory` (which
  compiles at jax's default precision, as users do) in a process without the suite's
  legacy-emitter flag, which moves CPU memory figures (tests/conftest.py)."""
  if platform == "tpu":
    require_libtpu()
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_cpu_use_fusion_emitters")]
  run = ["-c", _ONE_CORE] if platform == "tpu" else ["-m", "benchmarks.fallback_memory"]
  done = subprocess.run(
      [sys.executable, *run, f"--platforms={platform}", "--layers=0",
       f"--variants={','.join(VARIANTS)}"], cwd=ROOT, capture_output=True, text=True,
      env=dict(os.environ, XLA_FLAGS=" ".join(flags)), check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  report, _ = json.JSONDecoder().raw_decode(done.stdout)
  (row,) = report["rows"]
  return row["MiB"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", FALLBACKS)
@pytest.mark.parametrize("platform", PLATFORMS)
def test_fallback_memory_below_naive_loop_and_worst_case(platform, variant):
  mib = _mib(platform)
  assert mib[variant] < mib["fallback_unrolled"], mib
  assert mib[variant] < mib["worst_case"], mib


@pytest.mark.slow
@pytest.mark.parametrize("variant", FALLBACKS)
@pytest.mark.parametrize("platform", PLATFORMS)
def test_fallback_memory_within_ten_percent_of_capped(platform, variant):
  mib = _mib(platform)
  assert mib[variant] <= 1.10 * mib["capped"], mib
