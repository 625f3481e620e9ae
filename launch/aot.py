"""Compiles the full train step for a topology and prints device memory per MoE variant.

  python -m launch.aot --config=launch/configs/maverick.py --compile_topology=v5p-256 \
      [--variants=worst_case,capped,fallback_scan,step,...] [--config.KEY=VALUE ...]

The topology is a TPU slice (`v5p-256`, i.e. 128 chips, or `v5p:4x4x8`), compiled through
libtpu with no TPU attached, or `cpu:N` (N simulated CPU devices); jax stays on the CPU either
way (launch.platform), so it never takes the chips of a TPU VM. Every variant compiles the
same step as `launch.train` (value-and-grad, AdamW, donated state), differing only in the MoE
layers: the worst-case buffer, the capped buffer (rows may drop), capped + `layer` fallback
(scan of checkpointed chunks; also `fallback_adaptive`), `step` mode (dropless from the step's
first overflowing MoE layer on, on the config's path), and capped + a Python-unrolled chunk
loop (the naive form, `moe_hk.fallback.unrolled_chunks`). Prints JSON, then a table
of per-device memory (arguments + outputs + temporaries - aliased) from
`compiled.memory_analysis()`, and the step's matmul FLOPs (all devices, loops at their trip
counts: `launch.flops`; XLA's `cost_analysis()` counts a loop body once, so it is in the JSON
only) beside 6 x active parameters x tokens. A variant whose temporaries exceed the chip's HBM
does not compile for TPU; its row then shows the compiler's stated temporaries plus the
argument shards.
"""
import json
import math
import re
import time

import jax
import jax.numpy as jnp
import ml_collections
from absl import flags

import moe_hk
from launch import cli, flops as flops_lib, model as model_lib, platform, trainer, xla_programs
from launch.errors import UserError
from launch.steps import abstract_inputs, make_steps
from moe_hk import fallback

VARIANTS = ("worst_case", "capped", "fallback_scan", "fallback_adaptive", "step",
            "fallback_unrolled")
# Chips of a v5p slice (v5p-N counts TensorCores, 2 per chip) -> the slice's 3D torus shape.
V5P_SHAPES = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
              256: "4x8x8", 512: "8x8x8"}
GIB = 1024 ** 3
# HBM per chip as the TPU compiler states it when a program does not fit ("available HBM").
HBM_GIB = {"v5p": 95.74}

_CONFIG = cli.define_config("config", "maverick.py", "Model configuration file.")
_TOPOLOGY = flags.DEFINE_string("compile_topology", "v5p-256", "'v5p-N', 'v5p:AxBxC' or 'cpu:N'.")
_VARIANTS = flags.DEFINE_list("variants", ",".join(VARIANTS), f"Any of {', '.join(VARIANTS)}.")


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
  """Devices of `topology` ('v5p-256', 'v5p:4x4x8', 'cpu:8'); ValueError names the valid forms."""
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
    raise ValueError(f"--compile_topology={topology} must be 'v5p-N', 'v5p:AxBxC' or 'cpu:N'.")
  return list(xla_programs.tpu_topology_devices(topology))


def variant_config(config: ml_collections.ConfigDict, variant: str) -> ml_collections.ConfigDict:
  """`config` with its MoE layers set up as `variant` (the buffer factor is the config's)."""
  c = ml_collections.ConfigDict(config.to_dict())
  if variant == "worst_case":
    c.moe.ragged_buffer_factor = -1.0
  if variant in ("worst_case", "capped"):
    c.moe.moe_dropless_fallback = "none"
  elif variant == "step":
    c.moe.moe_dropless_fallback = "step"
  else:
    c.moe.moe_dropless_fallback = "layer"
    c.moe.dropless_fallback_chunking = "adaptive" if variant == "fallback_adaptive" else "fixed"
  return c


def compile_variant(config: ml_collections.ConfigDict, devices: list, variant: str) -> dict:
  """Compiles the train step of `variant` for `devices`; returns its memory figures (bytes)."""
  c = variant_config(config, variant)
  mesh = moe_hk.make_mesh(**c.mesh, devices=devices)
  steps = make_steps(c, mesh)
  state, batch = abstract_inputs(c, steps)
  start = time.perf_counter()
  # The naive chunk loop the scan is measured against, through the layer's comparison seam.
  swap = ({"chunk_loop": fallback.unrolled_chunks} if variant == "fallback_unrolled" else {})
  with fallback._comparison_forms(**swap):
    lowered = steps.train.lower(state, batch)
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    # The TPU compiler refuses a program whose temporaries exceed HBM and says how much.
    need = re.search(r"HLO temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)",
                     str(e))
    if not need:
      raise
    args = sum(per_device_bytes(a) for a in jax.tree.leaves((state, batch)))
    temp = int(float(need.group(1)) * GIB)
    return {"variant": variant, "compiled": False, "total_bytes": args + temp,
            "argument_bytes": args, "temp_bytes": temp,
            "hbm_bytes": int(float(need.group(2)) * GIB),
            "compile_seconds": round(time.perf_counter() - start, 1)}
  m = compiled.memory_analysis()
  return {"variant": variant, "compiled": True,
          "total_bytes": xla_programs.total_memory_bytes(compiled),
          "flops": flops_lib.matmul_flops(steps.train, state, batch),
          # Per device, each loop body once (XLA's cost analysis): a fraction of the step.
          "xla_cost_analysis_flops": (compiled.cost_analysis() or {}).get("flops", 0.0),
          "argument_bytes": int(m.argument_size_in_bytes),
          "output_bytes": int(m.output_size_in_bytes), "temp_bytes": int(m.temp_size_in_bytes),
          "alias_bytes": int(m.alias_size_in_bytes),
          "compile_seconds": round(time.perf_counter() - start, 1)}


def model_flops(config: ml_collections.ConfigDict) -> dict:
  """Parameters of the model (total, active per token) and 6 x active x tokens per step.

  Active: every parameter but the routed experts', plus K / E of those (a token runs K of the
  E experts); the tied embedding counts once (as the output projection). Attention's score
  and value matmuls (12 x layers x heads x head_dim x S / 2 per token, causal) are added
  separately: the 6N rule leaves them out."""
  c = variant_config(config, "capped")
  mesh = moe_hk.make_mesh(**{k: 1 for k in c.mesh}, devices=jax.devices()[:1])
  c.mesh = ml_collections.ConfigDict({k: 1 for k in c.mesh})
  c.data.batch_size = 1
  shapes = jax.eval_shape(make_steps(c, mesh).init, jax.random.key(0)).params
  total, routed = model_lib.parameter_counts(shapes)
  m = config.moe
  active = total - routed + routed * m.num_experts_per_tok / m.num_experts
  tokens = config.data.batch_size * config.data.seq_len
  return {"params": total, "active_params": active, "tokens": tokens,
          "six_n_t": 6 * active * tokens, "attention_flops": model_lib.attention_flops(config)}


def per_device_bytes(a: jax.ShapeDtypeStruct) -> int:
  """Bytes of one device's shard of `a`."""
  return math.prod(a.sharding.shard_shape(a.shape)) * jnp.dtype(a.dtype).itemsize


def main(argv):
  del argv  # launch.cli refuses arguments that are not flags
  unknown = sorted(set(_VARIANTS.value) - set(VARIANTS))
  if unknown:
    raise UserError(f"--variants={','.join(_VARIANTS.value)}: unknown {', '.join(unknown)}; "
                    f"valid: {', '.join(VARIANTS)}.")
  config = _CONFIG.value
  with cli.user_errors():
    platform.setup(cpu_device_count(_TOPOLOGY.value), cpu_only=True)
    devices = topology_devices(_TOPOLOGY.value)
    trainer.validate(config, devices=len(devices))
  rows = [compile_variant(config, devices, v) for v in _VARIANTS.value]
  model = model_flops(config)
  print(json.dumps({"topology": _TOPOLOGY.value, "devices": len(devices),
                    "platform": devices[0].platform, "mesh": dict(config.mesh),
                    "model": model, "results": rows}, indent=2))
  capped = next((r["total_bytes"] for r in rows if r["variant"] == "capped"), None)
  hbm = HBM_GIB.get(_TOPOLOGY.value.split("-")[0].split(":")[0])
  print(f"\nper-device memory, {_TOPOLOGY.value} ({len(devices)} devices), mesh "
        f"{dict(config.mesh)}" + (f", {hbm} GiB HBM per chip" if hbm else ""))
  print(f"{model['params'] / 1e9:.1f}B parameters, {model['active_params'] / 1e9:.2f}B active; "
        f"{model['tokens']} tokens per step: 6 x active x tokens = {model['six_n_t']:.3e} FLOPs, "
        f"+ attention {model['attention_flops']:.3e}")
  print("| variant | total GiB | args GiB | temp GiB | vs capped | compiler accepts temp | "
        "total fits HBM | matmul FLOPs | / (6NT + attention) | compile s |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    total = r["total_bytes"] / GIB
    ratio = f"{r['total_bytes'] / capped:.2f}x" if capped else "-"
    accepted = "yes" if r["compiled"] else f"no (> {r['hbm_bytes'] / GIB:.2f} GiB)"
    fits = "-" if hbm is None else ("yes" if total <= hbm else "no")
    flops = r.get("flops")
    flops_cells = (f"{flops:.3e} | {flops / (model['six_n_t'] + model['attention_flops']):.2f}"
                   if flops else "- | -")
    print(f"| {r['variant']} | {total:.2f} | {r['argument_bytes'] / GIB:.2f} | "
          f"{r['temp_bytes'] / GIB:.2f} | {ratio} | {accepted} | {fits} | {flops_cells} | "
          f"{r['compile_seconds']} |")


if __name__ == "__main__":
  cli.run(main)
