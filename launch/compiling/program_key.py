"""A compile's identity: what the compiler is given, as one digest, so that figures measured
once can be read back while the program, the compiler and its settings are the same.

The digest covers the lowered program (StableHLO without source locations), the versions of
jax, jaxlib and libtpu, the devices it is compiled for (kind, ids, coordinates) and the
settings that reach the compiler: the XLA flags of `XLA_FLAGS` and `LIBTPU_INIT_ARGS` (but
the simulated device count and dump locations) and jax's compile options. A Pallas TPU kernel
(megablox, splash attention) is a `tpu_custom_call` whose config carries the kernel as MLIR
bytecode with the source paths of its frames: each kernel counts as its text without
locations, so that two checkouts (or venvs) in different folders give one digest.
"""
from __future__ import annotations

import base64
import functools
import hashlib
import importlib.metadata
import os
import re
from typing import Sequence

import jax
# jax's own MLIR context and Mosaic dialect: a kernel's bytecode is parsed as jax parses it
# (jax._src.tpu_custom_call); no public API reads it.
from jax._src.interpreters import mlir
from jax._src.lib import tpu
from jax._src.lib.mlir import ir

# A kernel's bytecode and (jax 0.12) its frames' locations in a tpu_custom_call's config, as
# the StableHLO text prints them (`\22` is a quote).
_KERNEL_BODY = re.compile(r'\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22')
_KERNEL_LOCATIONS = re.compile(r', \\22debug_locations\\22: \\22[A-Za-z0-9+/=]*\\22')
# Flags that do not reach a compile's result: the simulated CPU device count and dumps.
_NOT_COMPILER = re.compile(r"--xla_(force_host_platform_device_count|dump_)")
# jax's settings that become compile options (jax._src.compiler.get_compile_options).
# (Those a jax version lacks count as absent.)
_COMPILE_OPTIONS = ("jax_use_shardy_partitioner", "jax_exec_time_optimization_effort",
                    "jax_memory_fitting_effort", "jax_optimization_level",
                    "jax_memory_fitting_level", "jax_compiler_enable_remat_pass",
                    "jax_disable_most_optimizations", "jax_xla_profile_version")


@functools.lru_cache(maxsize=None)
def _kernel_digest(body: str) -> str:
  """sha256 of the Mosaic kernel `body` (base64 MLIR bytecode) printed without locations."""
  context = mlir.make_ir_context()
  tpu.register_dialect(context)
  with context, ir.Location.unknown():
    context.allow_unregistered_dialects = True
    module = ir.Module.parse(base64.b64decode(body))
    return hashlib.sha256(module.operation.get_asm(enable_debug_info=False).encode()).hexdigest()


def program_text(lowered: jax.stages.Lowered) -> str:
  """The lowered program without source locations, each Pallas kernel as its digest."""
  text = _KERNEL_LOCATIONS.sub("", lowered.as_text(debug_info=False))
  return _KERNEL_BODY.sub(lambda m: f"kernel:{_kernel_digest(m.group(1))}", text)


def _version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "absent"


def compiler_settings() -> list[str]:
  """What reaches the compiler besides the program: package versions, XLA flags, options."""
  flags = sorted(f for var in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
                 for f in os.environ.get(var, "").split() if not _NOT_COMPILER.match(f))
  options = [f"{name}={jax.config.values.get(name, 'absent')}" for name in _COMPILE_OPTIONS]
  return [f"{p}=={_version(p)}" for p in ("jax", "jaxlib", "libtpu")] + flags + options


def program_key(lowered: jax.stages.Lowered, devices: Sequence[jax.Device]) -> str:
  """sha256 hex digest of `lowered` compiled for `devices` with this process's settings."""
  digest = hashlib.sha256()
  placement = [(d.device_kind, d.id, getattr(d, "coords", None), getattr(d, "core_on_chip", None))
               for d in devices]
  for part in (program_text(lowered), repr(placement), *compiler_settings()):
    digest.update(part.encode())
    digest.update(b"\0")
  return digest.hexdigest()
