"""Which devices jax runs on: the accelerator when one can be present, else simulated CPUs.

Every entry point calls `setup` first in its `main`, before anything starts a jax backend (no
module changes the environment at import). On a machine without a TPU or GPU it restricts jax
to the CPU, so a libtpu install neither waits for a TPU metadata server nor prints warnings.
An explicit JAX_PLATFORMS always wins, and a device count in XLA_FLAGS
(--xla_force_host_platform_device_count) wins over `cpu_devices`.
"""
from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os

import jax

# How a TPU VM exposes its chips: /dev/accel* (v2-v4), VFIO groups /dev/vfio/N (v5e and later).
TPU_DEVICE_FILES = ("accel*", "vfio/[0-9]*")
# What the NVIDIA driver (in Docker: nvidiactl; WSL2: dxg) and AMD's KFD driver create.
GPU_DEVICE_FILES = ("nvidia[0-9]*", "nvidiactl", "dxg", "kfd")


def _present(dev: str, patterns: tuple[str, ...]) -> bool:
  return any(glob.glob(os.path.join(dev, pattern)) for pattern in patterns)


def _gpu_plugin_installed() -> bool:
  """Whether a jax PJRT plugin (CUDA, ROCm) is installed, found the two ways jax finds one."""
  return bool(importlib.metadata.entry_points(group="jax_plugins")
              or importlib.util.find_spec("jax_plugins"))


def accelerator_possible(dev: str = "/dev") -> bool:
  """Whether jax could find a TPU or GPU, judged without starting a backend: the chip's device
  files under `dev` and the package jax drives it with (libtpu, a PJRT plugin)."""
  tpu = _present(dev, TPU_DEVICE_FILES) and importlib.util.find_spec("libtpu") is not None
  return tpu or (_present(dev, GPU_DEVICE_FILES) and _gpu_plugin_installed())


def setup(cpu_devices: int = 8, cpu_only: bool = False) -> str:
  """Chooses jax's platform before any backend starts; returns the platforms jax is asked for
  ('cpu', or '' for jax's own choice), as `launch.setup.distributed` takes them.

  Without JAX_PLATFORMS jax uses the accelerator when one can be present, else (or always with
  `cpu_only`) the CPU. The CPU backend gets `cpu_devices` devices. `cpu_only` is for the tools
  that compile for TPU topologies through libtpu, measure on the CPU or only read files: they
  never take chips a training run holds."""
  if cpu_only:
    # libtpu, loaded only to compile for a topology, needs no TPU VM's metadata (none to ask
    # for on another machine) and must load beside a process that holds the chips.
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  if jax.config.jax_platforms is None and (cpu_only or not accelerator_possible()):
    jax.config.update("jax_platforms", "cpu")
  # A count in XLA_FLAGS is the caller's (the tests', a multi-process launch's): it stays.
  if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    try:
      jax.config.update("jax_num_cpu_devices", cpu_devices)
    except RuntimeError:  # the backend already started (in-process tests): its devices stay
      pass
  return jax.config.jax_platforms or ""


def describe() -> str:
  """One line: the platform jax runs on, its devices and processes (starts the backend)."""
  device = jax.devices()[0]
  kind = "" if device.device_kind == device.platform else f" ({device.device_kind})"
  processes = jax.process_count()
  return (f"platform {device.platform}{kind}: {jax.device_count()} devices, "
          f"{jax.local_device_count()} local, {processes} process{'es' * (processes > 1)}")
