"""The MoE variants `launch.aot` compiles the train step in, and what each compile reports.

Every variant is the same train step (`launch.model.train_step`: value-and-grad, AdamW, the
donated state) with the run's MoE layers set up another way (`variant_layer`): the worst-case
buffer, the capped buffer (rows may drop), capped + the `layer` fallback with fixed or
adaptive chunks, `step` mode, and capped + a Python-unrolled chunk loop, the naive form the
fallback's scan is measured against (`moe_hk.fallback.unrolled_chunks`: never a mode users
pick).
"""
from __future__ import annotations

import dataclasses
import re
import time
from typing import Mapping, Sequence

import jax

import moe_hk
from launch.compiling import flops as flops_lib
from launch.compiling.program_key import program_key
from launch.model import memory, transformer as model_lib
from launch.model.train_step import abstract_inputs, make_steps
from launch.setup.settings import Settings
from moe_hk import buffer_size, fallback

VARIANTS = ("worst_case", "capped", "fallback_scan", "fallback_adaptive", "step",
            "fallback_unrolled")
GIB = 1024 ** 3


def trained_variant(layer: moe_hk.MoEConfig) -> str:
  """The variant `layer` trains as (what `launch.train` runs with it): `variant_layer` of it
  is `layer` itself."""
  if not layer.capped:
    return "worst_case"
  if not layer.falls_back:
    return "capped"
  if layer.step_fallback:
    return "step"
  return "fallback_adaptive" if layer.dropless_fallback_chunking == "adaptive" else "fallback_scan"


def variant_layer(layer: moe_hk.MoEConfig, variant: str) -> moe_hk.MoEConfig:
  """`layer` set up as `variant` (the buffer factor stays the run's, except the worst case)."""
  if variant == "worst_case":
    return dataclasses.replace(layer, ragged_buffer_factor=float(buffer_size.WORST_CASE),
                               moe_dropless_fallback="none")
  if variant == "capped":
    return dataclasses.replace(layer, moe_dropless_fallback="none")
  if variant == "step":
    return dataclasses.replace(layer, moe_dropless_fallback="step")
  chunking = "adaptive" if variant == "fallback_adaptive" else "fixed"
  return dataclasses.replace(layer, moe_dropless_fallback="layer",
                             dropless_fallback_chunking=chunking)


def compile_variant(settings: Settings, devices: Sequence[jax.Device], variant: str,
                    known: Mapping[str, dict] | None = None) -> dict:
  """Compiles the train step of `variant` for `devices`; returns its memory figures (bytes),
  matmul FLOPs, compile time and `program` (its `program_key`). A TPU program whose
  temporaries exceed HBM does not compile: its figures are then the compiler's stated
  temporaries plus the argument shards. A row of `known` (rows by `program`) for the same
  program key is returned instead of compiling, marked `"reused": true`."""
  # The naive loop, traced into this variant's own freshly built steps (`chunk_loop`).
  loop = fallback.unrolled_chunks if variant == "fallback_unrolled" else None
  with fallback.chunk_loop(loop):
    return _compile(settings._replace(layer=variant_layer(settings.layer, variant)), devices,
                    variant, known or {})


def _compile(run: Settings, devices: Sequence[jax.Device], variant: str,
             known: Mapping[str, dict]) -> dict:
  """`compile_variant` of the settings `run` (its layer set up as `variant`)."""
  mesh = moe_hk.make_mesh(**run.mesh, devices=devices)
  steps = make_steps(run, mesh)
  state, batch = abstract_inputs(run.config, steps)
  start = time.perf_counter()
  lowered = steps.train.lower(state, batch)
  key = program_key(lowered, devices)
  if key in known:
    return {**known[key], "variant": variant, "reused": True}
  row = {"variant": variant, "program": key}
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    need = re.search(r"HLO temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)",
                     str(e))
    if not need:
      raise
    args = sum(memory.per_device_bytes(a) for a in jax.tree.leaves((state, batch)))
    temp = int(float(need.group(1)) * GIB)
    return {**row, "compiled": False, "total_bytes": args + temp, "argument_bytes": args,
            "temp_bytes": temp, "hbm_bytes": int(float(need.group(2)) * GIB),
            "compile_seconds": round(time.perf_counter() - start, 1)}
  m = compiled.memory_analysis()
  return {**row, "compiled": True, "total_bytes": memory.total_memory_bytes(compiled),
          "flops": flops_lib.matmul_flops(steps.train, state, batch),
          # Per device, each loop body once (XLA's cost analysis): a fraction of the step.
          "xla_cost_analysis_flops": (compiled.cost_analysis() or {}).get("flops", 0.0),
          "argument_bytes": int(m.argument_size_in_bytes),
          "output_bytes": int(m.output_size_in_bytes), "temp_bytes": int(m.temp_size_in_bytes),
          "alias_bytes": int(m.alias_size_in_bytes),
          # What the program keeps in the host's memory (remat_policy 'full_inputs_on_host').
          "host_temp_bytes": int(m.host_temp_size_in_bytes),
          "compile_seconds": round(time.perf_counter() - start, 1)}


def model_flops(settings: Settings, devices: Sequence[jax.Device]) -> dict:
  """Parameters of the model (total, active per token) and 6 x active x tokens per step.

  Active: every parameter but the routed experts', plus K / E of those (a token runs K of the
  E experts); the tied embedding counts once (as the output projection). Attention's score
  and value matmuls (12 x layers x heads x head_dim x S / 2 per token, causal) are added
  separately: the 6N rule leaves them out."""
  mesh = moe_hk.make_mesh(**settings.mesh, devices=devices)
  shapes = jax.eval_shape(make_steps(settings, mesh).init, jax.random.key(0)).params
  total, routed = model_lib.parameter_counts(shapes)
  layer, data = settings.layer, settings.config.data
  active = total - routed + routed * layer.num_experts_per_tok / layer.num_experts
  tokens = data.batch_size * data.seq_len
  return {"params": total, "active_params": active, "tokens": tokens,
          "six_n_t": 6 * active * tokens,
          "attention_flops": model_lib.attention_flops(settings.config)}
