"""The shipped Maverick config keeps its memory: a 4-layer slice compiled for v5p-256.

`launch/configs/maverick.py` with `num_layers=4`: the real per-layer shapes, mesh (FSDP 8 x EP
16), dtypes, remat policy and fallback chunking, as few layers as still show the fallback
costing more than the capped step when it does (at 624d609 this slice measured the fallback
at 1.015x capped; two layers did not show it: docs/aot-memory.md). `python -m launch.aot`
compiles it in a child process, as users run it, and the figures must match the committed
baseline of the installed jax (`benchmarks/results/aot_maverick_slice_v5p-256_jax<V>.json`)
within 0.5%, with the fallback Maverick trains (the fixed scan) at most 1.01x the capped
step. A change that moves the figures on purpose regenerates the baseline with the command the
JSON records. The adaptive fallback's and step mode's figures are in the full model's table
(docs/aot-memory.md); compiling them here too would double the suite's longest test.
"""
import json
import os

import jax
import pytest

from tests.helpers import ROOT, require_libtpu, run_module

pytestmark = pytest.mark.slow

VARIANTS = ("capped", "fallback_scan")
BASELINE = os.path.join(ROOT, "benchmarks", "results",
                        f"aot_maverick_slice_v5p-256_jax{jax.__version__}.json")
COMMAND = ["launch.aot", "--config=launch/configs/maverick.py", "--config.num_layers=4",
           "--compile_topology=v5p-256", f"--variants={','.join(VARIANTS)}"]


def _bytes(report: dict) -> dict[str, int]:
  return {row["variant"]: row["total_bytes"] for row in report["results"]}


@pytest.fixture(scope="module")
def compiled() -> dict[str, int]:
  """Bytes per device of each variant's train step, from `python -m launch.aot` (once for the
  module, its tests on one worker: tests/conftest.py WORKER_GROUPS; a failure is kept too)."""
  require_libtpu()
  out = run_module(COMMAND + ["--results="], one_core=True)
  report, _ = json.JSONDecoder().raw_decode(out)
  return _bytes(report)


def _baseline() -> dict[str, int]:
  if not os.path.exists(BASELINE):
    pytest.fail(f"no baseline for jax {jax.__version__}: run `python -m "
                f"{' '.join(COMMAND)} --results={os.path.basename(BASELINE)[:-5]}` and commit "
                f"{os.path.relpath(BASELINE, ROOT)}")
  with open(BASELINE) as f:
    return _bytes(json.load(f))


@pytest.mark.parametrize("variant", VARIANTS)
def test_maverick_slice_bytes_match_the_committed_baseline(compiled, variant):
  now, then = compiled[variant], _baseline()[variant]
  assert abs(now - then) <= 0.005 * then, (
      f"{variant}: {now / 2**30:.2f} GiB per chip against the baseline's {then / 2**30:.2f} "
      f"({now / then - 1:+.2%}); a change that moves it on purpose regenerates {BASELINE}")


def test_maverick_slice_fallback_at_most_one_percent_over_capped(compiled):
  fallback, capped = compiled["fallback_scan"], compiled["capped"]
  assert fallback <= 1.01 * capped, (
      f"fallback_scan {fallback / 2**30:.2f} GiB per chip against capped {capped / 2**30:.2f} "
      f"({fallback / capped:.3f}x)")
