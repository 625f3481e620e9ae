"""What several test modules share: paths, the libtpu requirement, the small MoE models and the
launcher's tiny config with a step cache (no test module imports another)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import haiku as hk
import jax
import ml_collections
import pytest

import moe_hk
from launch.configs import tiny
from launch.setup import settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = "launch/configs/tiny.py"
# config.json files as their authors published them (its README.md says where each came from).
PUBLISHED = os.path.join(ROOT, "tests", "fixtures", "hf", "published")


def published(name: str) -> dict:
  """The published config.json `name` (its file name in PUBLISHED without .json)."""
  with open(os.path.join(PUBLISHED, f"{name}.json")) as f:
    return json.load(f)


def free_port() -> int:
  """A TCP port on the loopback interface that nothing listens on now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def user_precision():
  """A context at jax's default matmul precision, the one users, the benchmarks and
  `launch.aot` compile at. The suite's 'highest' (tests/conftest.py) serves the float32
  comparisons on CPU; in a TPU compile it turns each float32 matmul into several passes,
  which changes the compiler's fusions (so the memory figures) and slows it down."""
  return jax.default_matmul_precision("default")


def unavailable(reason: str) -> None:
  """Skips a test whose means are missing here, except in CI (`CI=true`), where it fails: CI
  has every means (the libtpu wheel, root), so a check there never turns into a quiet skip."""
  if os.environ.get("CI", "").lower() in ("1", "true"):
    pytest.fail(f"{reason} (CI must be able to run this test)")
  pytest.skip(reason)


def require_libtpu() -> None:
  """`unavailable` without the libtpu wheel matching jax (a partial install)."""
  try:
    import libtpu  # noqa: F401
  except ImportError:
    unavailable("needs the libtpu wheel matching jax (jax[tpu]: `make install` installs it) "
                "for the TPU compile checks")


# The metrics tests' three-layer model: layer 0 overflows and falls back, layer 1 overflows
# and drops, layer 2 has the worst-case buffer. Fixed chunking and XLA's ragged_dot: neither
# the chunking (tests/test_adaptive_fallback.py's subject) nor the grouped matmul
# (tests/test_grouped_matmul.py's) is theirs, and these compile quickest.
MESH_SHAPE = dict(data=2, expert=4)
BASE = dict(num_experts=8, num_experts_per_tok=2, emb_dim=16, mlp_dim=32, gmm_impl="ragged_dot",
            dropless_fallback_chunking="fixed")
LAYER_CONFIGS = [dict(ragged_buffer_factor=0.5, moe_dropless_fallback="layer"),
                 dict(ragged_buffer_factor=0.5, moe_dropless_fallback="none"),
                 dict(ragged_buffer_factor=-1)]


# The child pins itself (a preexec_fn could deadlock a threaded parent): argv[1] indexes the
# parent's cores in order.
_ON_ONE_CORE = ("import os, runpy, sys; cores = sorted(os.sched_getaffinity(0));"
                " os.sched_setaffinity(0, {cores[int(sys.argv[1])]}); sys.argv = sys.argv[2:];"
                " runpy.run_module(sys.argv[0], run_name='__main__')")


def child_xla_flags(without: tuple[str, ...] = (), **values) -> str:
  """`XLA_FLAGS` for a child process: the suite's (tests/conftest.py) less the flags named in
  `without` or `values` (names without their dashes), then `--NAME=VALUE` for each of
  `values`."""
  names = {f"--{name}" for name in (*without, *values)}
  kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] not in names]
  return " ".join([*kept, *(f"--{name}={value}" for name, value in values.items())])


def run_module(argv: list[str], core: int | None = None, xla_flags: str | None = None) -> str:
  """Runs `python -m argv[0] argv[1:]` in a child as users run it; returns its stdout.

  The child runs without the suite's legacy-emitter flag, which moves CPU memory figures
  (tests/conftest.py), or with `xla_flags` as its XLA_FLAGS when given. `core` pins it to one
  of this process's cores (an index into them in order, -1 the last), for TPU compiles:
  libtpu's compiler threads then use 14% less CPU (at 1.5x the wall time), and the suite,
  which keeps both cores busy, is bound by CPU (docs/testing.md). The two v5p compiles take
  different cores, so that they run side by side."""
  run = ["-m"] if core is None else ["-c", _ON_ONE_CORE, str(core)]
  if xla_flags is None:
    xla_flags = child_xla_flags(without=("xla_cpu_use_fusion_emitters",))
  env = dict(os.environ, XLA_FLAGS=xla_flags)
  done = subprocess.run([sys.executable, *run, *argv], cwd=ROOT, capture_output=True,
                        text=True, check=False, env=env)
  assert done.returncode == 0, f"exit status {done.returncode}:\n{done.stderr[-3000:]}"
  return done.stdout


class CompileAsked(Exception):
  """Raised in place of a compile by `forbid_compiles`."""


def forbid_compiles(monkeypatch) -> None:
  """From here on in the test, `Lowered.compile` raises CompileAsked: code that should read
  figures back shows that it compiled instead."""
  def compiling(*args, **kwargs):
    raise CompileAsked()
  monkeypatch.setattr(jax.stages.Lowered, "compile", compiling)


def unrolled_model(mesh) -> hk.TransformedWithState:
  """`(x [B, S, 16], step) -> x + sum of the LAYER_CONFIGS layers`, each rematerialised, stats
  in Haiku state under `moe_<i>`."""
  def forward(x, step):
    for i, overrides in enumerate(LAYER_CONFIGS):
      layer = moe_hk.MoELayer(moe_hk.MoEConfig(**BASE, **overrides), mesh, name=f"moe_{i}")
      x = x + hk.remat(lambda x_, layer=layer, i=i: layer(x_, step=step, layer_index=i))(x)
    return x
  return hk.transform_with_state(forward)


# The launcher tests' grouped matmul: XLA's ragged_dot, quicker to compile than the CPU default
# `blocked` (docs/testing.md; the backends are tests/test_grouped_matmul.py's and
# tests/test_layer.py's subject). Subprocess runs get it as a flag (TINY_FLAGS).
TINY_GMM = "ragged_dot"
TINY_FLAGS = (f"--config.moe.gmm_impl={TINY_GMM}",)


def tiny_config(**overrides) -> ml_collections.ConfigDict:
  """The launcher's tiny config with the tests' grouped matmul (TINY_GMM) and top-level
  fields replaced."""
  c = tiny.get_config()
  c.moe.gmm_impl = TINY_GMM
  c.update(overrides)
  return c


def settings_of(config: ml_collections.ConfigDict, devices: int | None = None,
                platform: str | None = None):
  """`launch.setup.settings.build` of `config` for this process's devices (or `devices`), checked
  for `platform` when given."""
  return settings.build(config, jax.device_count() if devices is None else devices,
                        platform=platform)


# Config keys the compiled steps never read (the loop's intervals, the host's data source, the
# autopilot's section, the traffic recorder's size), per section ('' for the top level): runs
# that differ only in them share their steps.
HOST_ONLY_KEYS = {
    "": ("checkpoint_every", "checkpoints_to_keep", "eval_every", "eval_batches", "log_every",
         "max_consecutive_nonfinite", "cpu_devices", "autopilot"),
    "data": ("source", "pattern", "max_bytes"),
    "traffic": ("max_mib",),
}


def cached_make_steps(make_steps):
  """`make_steps` memoised on the config's contents (less HOST_ONLY_KEYS), the MoE layers'
  config and the mesh: runs of one model in one test process share their jitted, so
  compiled, steps, as one long run would."""
  cache = {}

  def cached(run_settings, mesh, *args, **kwargs):
    if args or kwargs:
      return make_steps(run_settings, mesh, *args, **kwargs)
    key = json.loads(run_settings.config.to_json())
    if key.get("schedule_steps"):  # the schedule's length is set: train_steps is host-only
      key.pop("train_steps")
    for section, names in HOST_ONLY_KEYS.items():
      for name in names:
        (key[section] if section else key).pop(name, None)
    key = (json.dumps(key, sort_keys=True), run_settings.layer, mesh)
    if key not in cache:
      cache[key] = make_steps(run_settings, mesh)
    return cache[key]
  return cached
