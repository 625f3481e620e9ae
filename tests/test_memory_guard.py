"""The shipped Maverick config keeps its memory: its train step compiled for v5p-256.

`launch/configs/maverick.py` as it trains (48 layers, a remat unit per block, each block's
input on the host, FSDP 8 x EP 16): `python -m launch.aot` compiles the variant the config
trains (the fixed-chunk fallback, `fallback_scan`) in a child process, as users run it, in
about 7 minutes of one core. The whole model and not a slice: an 8-layer slice of two layer
groups, each one remat unit, moved -0.8% where the full step moved +21.2% (the MoE rows
gathered both ways), and -0.9% where it moved +11.0% (splash's fused backward, whose dq
partials grow with the sequence, with the loss's change); compiled, the full model costs about
what the slice did (docs/aot-memory.md).
Its bytes per chip must match the committed baseline of the installed jax
(`benchmarks/results/aot_maverick_v5p-256_jax<V>.json`, whose figures the README quotes) within
0.5% and be at most 1.01x the baseline's capped step (this is also the suite's v5p check of the
fixed-chunk fallback: tests/test_fallback_memory.py compiles only the adaptive one for v5p).
The capped step is not compiled here: one compile is what the suite's budget holds
(docs/testing.md says where the time goes). A change that moves the figures on purpose
regenerates the baseline with the command the JSON records.

`make test` runs the guard on the jax of `SUITE_LANE` only (Python 3.11 in CI): its compile is
minutes of one core, which the other lane's budget does not hold. `make test-memory` runs it
on any lane (`MOE_HK_MEMORY_GUARD=1`), against that jax's baseline.
"""
import json
import os

import jax
import pytest

from tests.helpers import ROOT, require_libtpu, run_module

pytestmark = pytest.mark.slow

# The jax whose compiler `make test` holds to its baseline; the other lanes' baselines are
# checked on demand (`make test-memory`, e.g. before moving the pins).
SUITE_LANE = "0.10.2"
ON_DEMAND = "MOE_HK_MEMORY_GUARD"
if jax.__version__ != SUITE_LANE and not os.environ.get(ON_DEMAND):
  pytest.skip(f"the memory guard runs in `make test` on jax {SUITE_LANE} only; `make "
              f"test-memory` runs it on this jax ({jax.__version__})", allow_module_level=True)

BASELINE = os.path.join(ROOT, "benchmarks", "results",
                        f"aot_maverick_v5p-256_jax{jax.__version__}.json")
COMMAND = ["launch.aot", "--config=launch/configs/maverick.py", "--compile_topology=v5p-256"]


def _bytes(report: dict) -> dict[str, int]:
  return {row["variant"]: row["total_bytes"] for row in report["results"]}


@pytest.fixture(scope="module")
def fallback() -> int:
  """Bytes per device of the fallback_scan train step, from `python -m launch.aot` (once for
  the module, its tests on one worker: tests/conftest.py WORKER_GROUPS)."""
  require_libtpu()
  out = run_module(COMMAND + ["--variants=fallback_scan", "--results="], core=-1)
  report, _ = json.JSONDecoder().raw_decode(out)
  return _bytes(report)["fallback_scan"]


@pytest.fixture(scope="module")
def baseline() -> dict[str, int]:
  if not os.path.exists(BASELINE):
    pytest.fail(f"no baseline for jax {jax.__version__}: run `python -m {' '.join(COMMAND)} "
                f"--variants=capped,fallback_scan --results={os.path.basename(BASELINE)[:-5]}` "
                f"and commit {os.path.relpath(BASELINE, ROOT)}")
  with open(BASELINE) as f:
    return _bytes(json.load(f))


def test_maverick_fallback_matches_the_committed_baseline(fallback, baseline):
  then = baseline["fallback_scan"]
  # What `make test-memory` reports (it shows the tests' output): both figures the checks use.
  print(f"\nmemory guard, jax {jax.__version__}: fallback_scan {fallback / 2**30:.2f} GiB per "
        f"chip, baseline {then / 2**30:.2f} ({fallback / then - 1:+.2%}); "
        f"{fallback / baseline['capped']:.3f}x the baseline's capped "
        f"{baseline['capped'] / 2**30:.2f}")
  assert abs(fallback - then) <= 0.005 * then, (
      f"fallback_scan: {fallback / 2**30:.2f} GiB per chip against the baseline's "
      f"{then / 2**30:.2f} ({fallback / then - 1:+.2%}); a change that moves it on purpose "
      f"regenerates {BASELINE}")


# Since b9cd5bd (the MoE rows gathered both ways) the full step's fallback is over its capped
# step: 1.091x (74.95 / 68.71 GiB) until the chunks gathered their own experts (f494af2), 1.042x
# (71.60) since. Open in issue 64, held failing here so that a fix shows (b75c5a8: 62.36 /
# 68.21, 0.914x).
@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="the fallback is 1.042x the capped step (issue 64)")
def test_maverick_fallback_at_most_one_percent_over_capped(fallback, baseline):
  capped = baseline["capped"]
  assert fallback <= 1.01 * capped, (
      f"fallback_scan {fallback / 2**30:.2f} GiB per chip against the baseline's capped "
      f"{capped / 2**30:.2f} ({fallback / capped:.3f}x)")
