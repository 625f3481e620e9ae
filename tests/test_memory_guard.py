"""The shipped Maverick config keeps its memory: its train step compiled for v5p-256.

`launch/configs/maverick.py` as it trains (48 layers, a remat unit per block, each block's
input on the host, FSDP 8 x EP 16): `python -m launch.aot` lowers the variant the config trains
(the fixed-chunk fallback, `fallback_scan`) in a child process, as users run it. Its bytes per
chip must match the committed baseline of the installed jax
(`benchmarks/results/aot_maverick_v5p-256_jax<V>.json`, whose figures the README quotes) within
0.5% and be at most 1.01x the baseline's capped step (this is also the suite's v5p check of the
fixed-chunk fallback: tests/test_fallback_memory.py holds only the adaptive one for v5p).

The compile takes 5 to 9 minutes of one core, more than the suite's budget holds
(docs/testing.md), and no smaller program holds the figures: an 8-layer slice of two layer
groups moved -0.8% where the full step moved +21.2%, and shorter sequences, XLA's attention or
another remat policy compile no faster (docs/aot-memory.md). So `make test` passes
`--reuse=<baseline>`: the baseline records the program key of what its compile was given
(`launch.compiling.program_key`: the lowered program, jax, jaxlib, libtpu, the devices, the
XLA flags), and a program with that key is the baseline's program, whose compile gives the
baseline's figures; any other program compiles here and is held to the figures. Then the
baseline is stale, and `test_the_baseline_is_of_this_program` fails until it is regenerated
with the command the JSON records, so that the suite's budget holds again. `make
test-memory` (`MOE_HK_MEMORY_GUARD=1`) always compiles, on any lane, against that jax's
baseline.

Each jax version has its baseline, so each lane of `make test` reads its own back.
"""
import json
import os

import jax
import pytest

from tests.helpers import ROOT, require_libtpu, run_module

pytestmark = pytest.mark.slow

ON_DEMAND = "MOE_HK_MEMORY_GUARD"  # `make test-memory`: compile, whatever the baseline holds
BASELINE = os.path.join(ROOT, "benchmarks", "results",
                        f"aot_maverick_v5p-256_jax{jax.__version__}.json")
COMMAND = ["launch.aot", "--config=launch/configs/maverick.py", "--compile_topology=v5p-256"]


def _rows(report: dict) -> dict[str, dict]:
  return {row["variant"]: row for row in report["results"]}


@pytest.fixture(scope="module")
def baseline() -> dict[str, dict]:
  """The baseline's rows by variant."""
  if not os.path.exists(BASELINE):
    pytest.fail(f"no baseline for jax {jax.__version__}: run `python -m {' '.join(COMMAND)} "
                f"--variants=capped,fallback_scan --jobs=2 "
                f"--results={os.path.basename(BASELINE)[:-5]}` and commit "
                f"{os.path.relpath(BASELINE, ROOT)}")
  with open(BASELINE) as f:
    return _rows(json.load(f))


@pytest.fixture(scope="module")
def fallback_row(baseline) -> dict:
  """The fallback_scan row of `python -m launch.aot` (once for the module, its tests on one
  worker: tests/conftest.py WORKER_GROUPS), with the XLA flags of a user's shell (none: the
  suite's quick-compile flags would be another compile); read back from the baseline when it
  is of this program, except under `make test-memory`."""
  require_libtpu()
  reuse = [] if os.environ.get(ON_DEMAND) else [f"--reuse={BASELINE}"]
  out = run_module(COMMAND + ["--variants=fallback_scan", "--results=", *reuse], core=-1,
                   xla_flags="")
  report, _ = json.JSONDecoder().raw_decode(out)
  return _rows(report)["fallback_scan"]


def test_the_baseline_is_of_this_program(fallback_row, baseline):
  """The program `make test` lowers is the one the baseline compiled, so that its figures are
  read back and the guard costs seconds, not minutes."""
  assert fallback_row["program"] == baseline["fallback_scan"].get("program"), (
      f"the baseline {os.path.relpath(BASELINE, ROOT)} was compiled from another program (the "
      f"layer, the Maverick config, jax, libtpu or the XLA flags changed since), so the guard "
      f"compiled this one ({fallback_row['compile_seconds']} s; its figures are checked by "
      f"the other tests): regenerate the baseline with the command it records and commit it")


def test_maverick_fallback_matches_the_committed_baseline(fallback_row, baseline):
  fallback = fallback_row["total_bytes"]
  then = baseline["fallback_scan"]["total_bytes"]
  # What `make test-memory` reports (it shows the tests' output): both figures the checks use.
  capped = baseline["capped"]["total_bytes"]
  how = "read back: the baseline's program" if fallback_row.get("reused") else "compiled"
  print(f"\nmemory guard, jax {jax.__version__}: fallback_scan {fallback / 2**30:.2f} GiB per "
        f"chip ({how}), baseline {then / 2**30:.2f} ({fallback / then - 1:+.2%}); "
        f"{fallback / capped:.3f}x the baseline's capped {capped / 2**30:.2f}")
  assert abs(fallback - then) <= 0.005 * then, (
      f"fallback_scan: {fallback / 2**30:.2f} GiB per chip against the baseline's "
      f"{then / 2**30:.2f} ({fallback / then - 1:+.2%}); a change that moves it on purpose "
      f"regenerates {BASELINE}")


# On jax 0.10.2, since b9cd5bd (the MoE rows gathered both ways) the full step's fallback is over
# its capped step: 1.091x (74.95 / 68.71 GiB) until the chunks gathered their own experts
# (f494af2), 1.042x (71.60) since. Open in issue 64, held failing here so that a fix shows
# (b75c5a8: 62.36 / 68.21, 0.914x). jax 0.12's compiler: 0.868x (64.07 / 73.80).
@pytest.mark.xfail(jax.__version__ == "0.10.2", strict=True, raises=AssertionError,
                   reason="jax 0.10.2's fallback is 1.042x the capped step (issue 64)")
def test_maverick_fallback_at_most_one_percent_over_capped(fallback_row, baseline):
  fallback = fallback_row["total_bytes"]
  capped = baseline["capped"]["total_bytes"]
  assert fallback <= 1.01 * capped, (
      f"fallback_scan {fallback / 2**30:.2f} GiB per chip against the baseline's capped "
      f"{capped / 2**30:.2f} ({fallback / capped:.3f}x)")
