"""The devices a program is compiled for: a TPU slice through libtpu, or simulated CPUs.

A TPU topology needs the libtpu wheel matching jax (`jax[tpu]==<jax version>`) but no TPU:
`jax.jit(f).lower(...).compile()` then compiles for that topology from any machine.
"""
from __future__ import annotations

import re
from typing import Sequence

import jax
from absl import flags
from jax.experimental import topologies

# Chips of a v5p slice (v5p-N counts TensorCores, 2 per chip) -> the slice's 3D torus shape.
V5P_SHAPES = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
              256: "4x8x8", 512: "8x8x8"}
# HBM per chip as the TPU compiler states it when a program does not fit ("available HBM").
HBM_GIB = {"v5p": 95.74, "v5e": 15.75}


def tpu_topology_devices(topology: str) -> Sequence[jax.Device]:
  """Devices of a TPU topology such as 'v5p:2x2x1' or 'v5e:1x1' (needs libtpu, not a TPU).

  libtpu takes a slice smaller than its generation's host (v5e hosts hold 2x2 chips) only
  with the chips per host given: one host holding the whole slice."""
  dims = tuple(int(d) for d in topology.split(":")[1].split("x"))
  small = dims[:2] in ((1, 1), (1, 2), (2, 1)) and topology.startswith("v5e:")
  bounds = dict(chips_per_host_bounds=(*dims[:2], 1)) if small else {}
  return topologies.get_topology_desc(platform="tpu", topology_name=topology, **bounds).devices


def cpu_device_count(topology: str) -> int:
  """The CPU devices jax needs for `topology`: N of 'cpu:N'; 1 for a TPU slice, which compiles
  through libtpu (the CPU only traces). ValueError for a 'cpu:' without a count."""
  if not topology.startswith("cpu:"):
    return 1
  if not re.fullmatch(r"[1-9]\d*", topology[4:]):
    raise ValueError(f"--compile_topology={topology} must be 'cpu:N' with N >= 1 (or 'v5p-N', "
                     "'v5p:AxBxC').")
  return int(topology[4:])


def topology_devices(topology: str) -> list:
  """Devices of `topology` ('v5p-256', 'v5p:4x4x8', 'v5e:1x1', 'cpu:8'); ValueError names the
  valid forms."""
  if topology.startswith("cpu:"):
    want = cpu_device_count(topology)
    if jax.device_count() < want:
      raise ValueError(f"--compile_topology={topology}: only {jax.device_count()} CPU devices "
                       f"(the backend started before it could be given {want}).")
    return jax.devices()[:want]
  match = re.fullmatch(r"v5p-(\d+)", topology)
  if match:
    chips = int(match.group(1)) // 2
    if chips not in V5P_SHAPES:
      raise ValueError(f"--compile_topology={topology}: v5p-N needs N in "
                       f"{sorted(2 * c for c in V5P_SHAPES)}; or give 'v5p:AxBxC'.")
    topology = f"v5p:{V5P_SHAPES[chips]}"
  if not re.fullmatch(r"v\w+:\d+x\d+(x\d+)?", topology):
    raise ValueError(f"--compile_topology={topology} must be 'v5p-N', 'v5p:AxBxC', 'v5e:AxB' "
                     "or 'cpu:N'.")
  return list(tpu_topology_devices(topology))


def hbm_gib(topology: str) -> float | None:
  """HBM per chip of `topology`'s TPU generation, when known."""
  return HBM_GIB.get(topology.split("-")[0].split(":")[0])


def topology_flag(default: str | None, help_text: str) -> flags.FlagHolder:
  """`--compile_topology`, which `launch.aot` and `launch.capacity` both take: defined by the
  first of them imported (a process that imports both, as the tests do, shares one flag)."""
  if "compile_topology" in flags.FLAGS:
    return flags.FlagHolder(flags.FLAGS, flags.FLAGS["compile_topology"])
  return flags.DEFINE_string("compile_topology", default, help_text)
