"""Test setup, before jax is imported anywhere: 8 simulated CPU devices and quick CPU compiles.

The suite's time is XLA:CPU compile time. `QUICK_COMPILE` cuts LLVM's optimisation of the
generated code (compile ~1.5x faster) and selects XLA:CPU's fast-compile preset (20% less CPU on
jaxlib 0.12's fusion emitters, none under the legacy ones); compiled memory figures are the same
with and without them (docs/testing.md). `LEGACY_EMITTERS`, where jaxlib still has
them (0.10, Python 3.11; 0.12 removed the flag, and an unknown XLA flag aborts the process),
compiles the tiny train step in 5 s instead of 9 but moves CPU memory figures by up to 1.5%:
tests/test_fallback_memory.py measures in a process without it. Subprocesses the tests start
inherit the flags.
"""
import gc
import importlib.metadata
import os
import re
import shutil
import tempfile

import pytest

QUICK_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                 "--xla_cpu_opt_preset=FAST_COMPILE")
LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
_JAXLIB = tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2])
# `make test-tpu` (MOE_HK_TPU=1) runs the tests marked `tpu` on the host's chip: jax keeps its
# accelerator there. Everywhere else the suite runs on 8 simulated CPU devices, and the `tpu`
# tests skip (tests/test_tpu_chip.py).
ON_CHIP = os.environ.get("MOE_HK_TPU") == "1"
_RUN_CACHE = None  # the compilation cache folder this process made (below)
if not ON_CHIP:
  os.environ["XLA_FLAGS"] = " ".join([
      os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8",
      *QUICK_COMPILE, *([LEGACY_EMITTERS] if _JAXLIB < (0, 11) else [])]).strip()
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # libtpu is installed; not a TPU VM.
  # Only AOT compilation uses libtpu here; let it load beside another process doing the same.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  # One compilation cache for the run: jax's persistent cache in a folder this process makes
  # and removes at the end, inherited by the workers and the children the tests start. A
  # program compiled once (the same model in another test, on the other worker, in a
  # `launch.train` child) is then read back, not compiled again; jax 0.12 caches programs
  # with host callbacks too (the train steps), jax 0.10 does not. A folder set beforehand
  # (JAX_COMPILATION_CACHE_DIR) is used as it is and kept. A size limit turns on jax's file
  # lock around each entry's read and write, so that no process reads one half written.
  if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _RUN_CACHE = tempfile.mkdtemp(prefix="moe-hk-test-programs-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _RUN_CACHE
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(4 << 30)

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Python's cyclic collector runs every 700 net allocations by default and walks the young
# objects each time; tracing a program allocates millions (tracers, jaxpr equations), so the
# workers spent ~8% of their CPU there (test_nonfinite.py + test_fallback.py: 146 -> 134 s of
# CPU with these thresholds, one process, docs/testing.md). Cycles are still collected.
gc.set_threshold(100_000, 50, 1000)


# Tests that share a module-level cache or fixture (a compiled program, a trained run) run on
# one pytest-xdist worker: nodeid pattern -> worker group (`make test` runs two workers).
# xdist's `xdist_group` marks cannot do it under pytest 9 (xdist renames the nodeid by writing
# `item._nodeid`, which pytest 9 no longer reads), so the groups are declared here, longest
# first: they are handed out in this order (`pytest_collection_modifyitems`), so that the other
# worker drains the short tests while one holds a long group.
WORKER_GROUPS = (
    # The memory guard: seconds while its baseline is of the program it lowers, else a compile
    # of minutes, on the last core (tests/test_memory_guard.py).
    (r"tests/test_memory_guard\.py::", "memory_guard"),
    # The other v5p compiles (`helpers.run_module`, the first core), on one worker for both
    # platforms: run side by side, libtpu's compiler threads and XLA:CPU's compile slow each
    # other down more than running one after the other.
    (r"tests/test_fallback_memory\.py::", "fallback_memory"),
    # The stop-signal tests and the default job's run (other models) share neither the
    # launcher tests' step cache nor their baseline run.
    (r"tests/test_launch\.py::(?!test_a_stop_signal_|test_the_default_jobs_)", "launch"),
    # The two stop signals' runs: one config, so the second reuses the first's compiled steps.
    (r"tests/test_launch\.py::test_a_stop_signal_", "stop_signal"),
    (r"tests/test_convert\.py::", "convert"),  # the imported runs, module fixtures
    (r"tests/test_tpu_aot\.py::", "tpu_aot"),
    (r"tests/test_metrics_tensorboard\.py::", "metrics_tensorboard"),
    (r"tests/test_adaptive_fallback\.py::.*\b(all_to_all|ring)\]$", r"adaptive_\1"),
    (r"tests/test_step_mode\.py::.*\b(all_to_all|ring)\]$", r"step_mode_\1"),
    (r"tests/test_grouped_matmul\.py::test_expert_mlp_.*-(\w+-\d+)\]$", r"grouped_matmul_\1"),
)


def _group(nodeid: str) -> tuple[int, str | None]:
  """The WORKER_GROUPS entry of `nodeid`: its index and group name, or (len, None)."""
  for index, (pattern, group) in enumerate(WORKER_GROUPS):
    match = re.match(pattern, nodeid)
    if match:
      return index, match.expand(group)
  return len(WORKER_GROUPS), None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """Load scheduling (each test to the next free worker), except that the tests of one
  WORKER_GROUPS group go to the same worker, one after another, in the order of
  `pytest_collection_modifyitems` (xdist would hand the groups with the most tests out first)."""
  from xdist.scheduler import LoadScopeScheduling

  class GroupScheduling(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
      return _group(nodeid)[1] or nodeid
  config.option.loadscopereorder = False
  return GroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
  """Longest first: the worker groups in WORKER_GROUPS order, then the other slow tests, then
  the quick ones, so that the two workers finish together."""
  items.sort(key=lambda item: (_group(item.nodeid)[0],
                               item.get_closest_marker("slow") is None))


def pytest_unconfigure(config):
  """Removes the run's compilation cache, in the process that made it."""
  if _RUN_CACHE is not None:
    shutil.rmtree(_RUN_CACHE, ignore_errors=True)
