"""`launch.setup.platform`: jax on the TPU or GPU when one can be present, else N simulated CPUs,
chosen before any backend starts; `launch.aot`'s CPU device count per topology."""
import os
import subprocess
import sys

import jax
import pytest

from launch.compiling import topology as topology_lib
from launch.setup import platform
from tests.helpers import ROOT, require_libtpu


def fake_dev(tmp_path, *names: str) -> str:
  """A stand-in for /dev holding the files `names` (`vfio/0`: in its folder)."""
  for name in names:
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).touch()
  return str(tmp_path)


@pytest.mark.parametrize("files,possible", [
    ((), False),
    (("null", "vfio/vfio"), False),   # the VFIO control file alone: no chip
    (("accel0", "accel1"), True),     # TPU v2-v4 VM
    (("vfio/0", "vfio/vfio"), True),  # TPU v5e and later
])
def test_tpu_device_files_mean_a_tpu_may_be_present(tmp_path, files, possible):
  require_libtpu()
  assert platform.accelerator_possible(fake_dev(tmp_path, *files)) == possible


@pytest.mark.parametrize("files,plugin,possible", [
    (("nvidia0", "nvidiactl"), False, False),  # a GPU, but nothing for jax to drive it with
    (("nvidia0", "nvidiactl"), True, True),
    (("nvidiactl",), True, True),             # Docker
    (("kfd",), True, True),                   # ROCm
    (("null",), True, False),                 # a plugin, but no GPU
])
def test_a_gpu_needs_its_device_files_and_a_jax_plugin(tmp_path, monkeypatch, files, plugin,
                                                       possible):
  monkeypatch.setattr(platform, "_gpu_plugin_installed", lambda: plugin)
  assert platform.accelerator_possible(fake_dev(tmp_path, *files)) == possible


def test_setup_keeps_a_started_backend(monkeypatch):
  """The tests' backend (JAX_PLATFORMS=cpu, 8 devices) is running: setup changes nothing and
  does not fail, with a device count in XLA_FLAGS or without one."""
  assert jax.device_count() == 8
  assert platform.setup() == "cpu"
  monkeypatch.setenv("XLA_FLAGS", "")
  assert platform.setup(4) == platform.setup(4, cpu_only=True) == "cpu"
  assert jax.device_count() == 8 and jax.default_backend() == "cpu"


def test_describe_says_platform_devices_and_processes():
  assert platform.describe() == "platform cpu: 8 devices, 8 local, 1 process"


@pytest.mark.parametrize("possible,cpu_only,chosen", [
    (True, False, ""),       # jax's own choice: the TPU or GPU
    (True, True, "cpu"),     # the compiling and reading tools never take the chips
    (False, False, "cpu"),
])
def test_without_jax_platforms_setup_leaves_an_accelerator_to_jax(possible, cpu_only, chosen):
  """In a fresh process without JAX_PLATFORMS, with device files that say a chip may be there
  (`accelerator_possible`, stubbed), `setup` leaves the platform to jax; without them, or for
  a tool, it asks for the CPU. No backend starts."""
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  code = (f"from launch.setup import platform; platform.accelerator_possible = lambda: {possible}; "
          f"import jax; print(repr(platform.setup(3, cpu_only={cpu_only}))); "
          "print(jax.config.jax_platforms)")
  done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  assert done.stdout.splitlines() == [repr(chosen), str(chosen or None)]


def test_without_jax_platforms_a_cpu_machine_starts_quietly_on_n_cpu_devices():
  """No JAX_PLATFORMS, no XLA_FLAGS, libtpu installed, no TPU or GPU: the CPU backend with the
  devices asked for, and not a line on stderr (no libtpu or backend warnings)."""
  if platform.accelerator_possible():
    pytest.skip("this machine has TPU or GPU device files: the quiet CPU-only start this "
                "checks applies only to a machine without an accelerator (CI's has none)")
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "TPU_SKIP_MDS_QUERY",
                      "ALLOW_MULTIPLE_LIBTPU_LOAD")}
  code = "from launch.setup import platform; print(platform.setup(3)); print(platform.describe())"
  done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  assert done.stdout.splitlines() == ["cpu", "platform cpu: 3 devices, 3 local, 1 process"]
  assert done.stderr == ""


@pytest.mark.parametrize("topology,devices", [("cpu:4", 4), ("cpu:64", 64), ("v5p-16", 1),
                                              ("v5p:2x2x2", 1)])
def test_aot_starts_jax_with_the_topologys_cpu_devices(topology, devices):
  assert topology_lib.cpu_device_count(topology) == devices


@pytest.mark.parametrize("topology", ["cpu:", "cpu:x", "cpu:0", "cpu:-2"])
def test_aot_refuses_a_cpu_topology_without_a_count(topology):
  with pytest.raises(ValueError, match=f"--compile_topology={topology} must be 'cpu:N' with "
                                       "N >= 1"):
    topology_lib.cpu_device_count(topology)


def test_make_test_tpus_collection_holds_on_a_one_device_host():
  """`make test-tpu` collects every test module on the chip's host, where jax has one device:
  no module may build a mesh of several devices at import (a one-chip host failed so)."""
  env = {**os.environ, "MOE_HK_TPU": "1", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  done = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "tpu",
                         "-p", "no:cacheprovider", "tests"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert "tests/test_tpu_chip.py::" in done.stdout, done.stdout[-2000:]
