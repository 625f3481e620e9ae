"""Compiler-measured memory of the fallback (docs/design.md), on a CPU mesh and a v5p topology.

One layer where token buffers dominate (8 shards, top-2, 8 experts, 64 x 512 tokens, emb 1024,
MLP 2048, factor 2): a value-and-grad step with the fallback must stay within 1.10 x the capped
step on both, and on the CPU mesh below both the naive unrolled chunk loop and the worst-case
buffer. On v5p this layer compiles the capped step and the adaptive fallback only: the fixed
chunks' fallback is the memory guard's compile (tests/test_memory_guard.py: the Maverick slice's
train step, at most 1.01x its capped step), and the v5p compiles are the suite's costliest.
"""
import functools
import json

import jax
import pytest

from tests.helpers import require_libtpu, run_module

# One worker compiles each platform's variants once for all the module's tests
# (tests/conftest.py WORKER_GROUPS).

PLATFORMS = ["cpu", "tpu"]
# The library's modes: the fixed scan fallback, and adaptive chunking (a switch over the
# capped path and the rungs (8, 0.16 R), (8, 0.20 R), (8, R / 4)).
FALLBACKS = ["fallback_scan", "fallback_adaptive"]
VARIANTS = {"cpu": ("worst_case", "capped", "fallback_unrolled", *FALLBACKS),
            "tpu": ("capped", "fallback_adaptive")}


@functools.lru_cache(maxsize=None)
def _mib(platform: str) -> dict:
  """MiB per device of each variant's step, from `python -m benchmarks.fallback_memory` (which
  compiles at jax's default precision, as users do)."""
  if platform == "tpu":
    require_libtpu()
  out = run_module(["benchmarks.fallback_memory", f"--platforms={platform}", "--layers=0",
                    f"--variants={','.join(VARIANTS[platform])}", "--results="],
                   core=0 if platform == "tpu" else None)  # the guard's compile takes -1
  report, _ = json.JSONDecoder().raw_decode(out)
  (row,) = report["rows"]
  return row["MiB"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", FALLBACKS)
def test_fallback_memory_below_naive_loop_and_worst_case(variant):
  mib = _mib("cpu")
  assert mib[variant] < mib["fallback_unrolled"], mib
  assert mib[variant] < mib["worst_case"], mib


# Under jax 0.12 the v5p compile of the adaptive fallback is 1.11x its capped step (788.5 /
# 708.1 MiB) since the capped step lost its regrouping gathers and the psum of its buffer's
# cotangent (898.2 MiB before; the fallback 806.9): open in issue 66, held failing here so
# that a fix shows (jax 0.10.2: 970.2 / 899.0 MiB, 1.08x).
ADAPTIVE_OVER_ON_JAX_012 = pytest.mark.xfail(
    jax.__version__ != "0.10.2", strict=True,
    reason="jax 0.12's v5p adaptive fallback is 1.11x the capped step (issue 66)")


@pytest.mark.slow
@pytest.mark.parametrize("platform,variant", [
    pytest.param(platform, variant, marks=ADAPTIVE_OVER_ON_JAX_012
                 if (platform, variant) == ("tpu", "fallback_adaptive") else ())
    for platform in PLATFORMS for variant in VARIANTS[platform] if variant in FALLBACKS])
def test_fallback_memory_within_ten_percent_of_capped(platform, variant):
  mib = _mib(platform)
  assert mib[variant] <= 1.10 * mib["capped"], mib
