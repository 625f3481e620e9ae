"""Device memory of a train step per fallback variant, from the compiler, on CPU and TPU.

  python -m benchmarks.fallback_memory [--platforms=cpu,tpu] [--layers=1,4,8] [--remat=full]
      [--reuse=FILE]

For each platform (an 8-device CPU mesh, and a v5p 2x2x2 topology compiled through libtpu)
and each model (one bare MoE layer; stacks of rematerialised MoE layers trained with Adam),
compiles the step and prints total memory per device (arguments + outputs + temp - aliased)
and the compile time for: the worst-case buffer, the capped buffer, capped + `layer` fallback
(scan of checkpointed chunks), the same with adaptive chunking
(`moe_hk.fallback.traffic_ladder`), and capped + fallback with a Python-unrolled chunk loop (the
naive form, `moe_hk.fallback.unrolled_chunks`, traced in with `moe_hk.fallback.chunk_loop`).
Each rung of the adaptive ladder is a compiled switch branch, so its column
measures what rungs cost. `--factor` sets the buffer factor (a lower one lengthens the adaptive
ladder). Each row records each variant's `programs` key (`launch.compiling.program_key`);
`--reuse=FILE` reads back the MiB of every variant whose key an earlier results file holds
instead of compiling it (tests/test_fallback_memory.py reads its committed baselines so).
`--remat` names the layers' remat policy (the launcher's `remat_policy` values: 'full' saves
nothing, 'save_matmuls' keeps the matmul outputs, as `launch/configs/tpu_chip.py` trains).
JSON first, then a table.
"""
from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

import moe_hk
from launch.compiling import topology
from launch.compiling.program_key import program_key
from launch.model import memory, transformer
from launch.setup import platform as launch_platform, results
from launch.setup.errors import UserError
from moe_hk import fallback, mesh as mesh_lib

# The single-layer setting where token buffers dominate: 8 shards, top-2, 8 experts,
# 64 x 512 tokens (4,096 per shard), emb 1024, MLP 2048. Not narrower: on TPU a width of 64 is
# padded to 128 lanes and small buffers land in on-chip VMEM, so the figures measure layout
# rather than the fallback (`--emb_dim=64 --mlp_dim=128` reproduces them; README).
SETTING = dict(num_experts=8, num_experts_per_tok=2, emb_dim=1024, mlp_dim=2048,
               moe_dropless_fallback="none")  # the capped variant; the others set theirs
BATCH, SEQ = 64, 512
SETTING["ragged_buffer_factor"] = 2.0
VARIANTS = ("worst_case", "capped", "fallback_scan", "fallback_adaptive", "fallback_unrolled")
# The setting's automatic chunk count is 2; the adaptive variant asks for 8 chunks, so that
# `traffic_ladder` has (8, 0.16 R), (8, 0.20 R), (8, R / 4) at factor 2 (no rung's chunks
# above the fixed rung's), and five rungs and (8, R / 2) at factor 1.
ADAPTIVE_MAX_CHUNKS = 8


def variant_config(variant: str, **overrides) -> moe_hk.MoEConfig:
  """The setting as `variant`; `overrides` replace fields of SETTING (e.g. a narrower width)."""
  base = moe_hk.MoEConfig(**{**SETTING, **overrides})
  adaptive = base.replace(moe_dropless_fallback="layer", dropless_fallback_chunking="adaptive",
                          dropless_fallback_num_chunks=ADAPTIVE_MAX_CHUNKS)
  return {
      "worst_case": base.replace(ragged_buffer_factor=-1),
      "capped": base,
      "fallback_scan": base.replace(moe_dropless_fallback="layer",
                                    dropless_fallback_chunking="fixed"),
      "fallback_adaptive": adaptive,
      "fallback_unrolled": base.replace(moe_dropless_fallback="layer",
                                        dropless_fallback_chunking="fixed"),
  }[variant]


def variant_layer(config: moe_hk.MoEConfig, mesh):
  """`(params, x) -> (y, stats)` of a variant's layer."""
  return functools.partial(moe_hk.moe_forward, config=config, mesh=mesh)


def make_mesh(platform: str):
  devices = (topology.tpu_topology_devices("v5p:2x2x2") if platform == "tpu"
             else jax.devices()[:8])
  return moe_hk.make_mesh(expert=8, devices=devices)


def _layer_params(config):
  e, d, f = config.num_experts, config.emb_dim, config.mlp_dim
  return moe_hk.MoEParams(jnp.zeros((d, e)), jnp.zeros((e, d, f)), jnp.zeros((e, d, f)),
                          jnp.zeros((e, f, d)))


def lower_step(variant: str, platform: str, layers: int, remat: str = "full"
               ) -> tuple[jax.stages.Lowered, list[jax.Device]]:
  """Lowers the step and returns it with the devices it is for. layers == 0: one bare
  layer's value-and-grad (no optimizer, no remat). layers >= 1: a scan over that many
  residual MoE layers whose body is a jax.checkpoint under `remat` (a
  `transformer.REMAT_POLICIES` name), with an Adam update and donated params and optimizer
  state. `fallback_unrolled` traces the naive chunk loop the scan is measured against."""
  loop = fallback.unrolled_chunks if variant == "fallback_unrolled" else None
  with fallback.chunk_loop(loop):
    return _lower_step(variant, platform, layers, transformer.REMAT_POLICIES[remat])


def _lower_step(variant: str, platform: str, layers: int, policy):
  config = variant_config(variant)
  mesh = make_mesh(platform)
  layer = variant_layer(config, mesh)
  specs = moe_hk.param_specs(config, mesh)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  x = jax.ShapeDtypeStruct((BATCH, SEQ, config.emb_dim), jnp.float32,
                           sharding=NamedSharding(mesh, mesh_lib.batch_spec(mesh)))

  if layers == 0:
    def loss(p, xx):
      y, stats = layer(p, xx)
      return jnp.mean(y ** 2) + stats.lb_loss
    params = memory.abstract_like(_layer_params(config), shardings)
    return jax.jit(jax.value_and_grad(loss)).lower(params, x), list(mesh.devices.flat)

  # Layers as a scan over stacked params with a rematerialised body, as large MoE models train.
  remat_layer = jax.checkpoint(layer, policy=policy)
  def loss(stacked, xx):
    def body(carry, p):
      xx_, aux = carry
      y, stats = remat_layer(p, xx_)
      return (xx_ + y, aux + stats.lb_loss), None
    (xx, aux), _ = jax.lax.scan(body, (xx, 0.0), stacked)
    return jnp.mean(xx ** 2) + aux
  tx = optax.adam(1e-3)
  def step(ps, opt_state, xx):
    value, grads = jax.value_and_grad(loss)(ps, xx)
    updates, opt_state = tx.update(grads, opt_state, ps)
    return optax.apply_updates(ps, updates), opt_state, value
  stack = lambda a: jnp.zeros((layers, *a.shape), a.dtype)
  concrete = jax.tree.map(stack, _layer_params(config))
  stacked_shardings = jax.tree.map(
      lambda s: NamedSharding(mesh, jax.sharding.PartitionSpec(None, *s)), specs)
  params = memory.abstract_like(concrete, stacked_shardings)
  opt_state = jax.eval_shape(tx.init, concrete)
  replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
  opt_shardings = optax.tree_map_params(tx, lambda _, s: s, opt_state, stacked_shardings,
                                        transform_non_params=lambda _: replicated)
  opt_state = memory.abstract_like(opt_state, opt_shardings)
  lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, x)
  return lowered, list(mesh.devices.flat)


def measure(platforms, layer_counts, variants=VARIANTS, remat: str = "full",
            known: dict[str, float] | None = None):
  """Per platform and model: total MiB per device and compile seconds of each variant, the
  layers rematerialised under `remat`, and each variant's program key (`programs`). A
  variant whose program key `known` holds takes its MiB from there, not from a compile (its
  seconds: None)."""
  known = known or {}
  rows = []
  for platform in platforms:
    for layers in layer_counts:
      mib, seconds, programs = {}, {}, {}
      for v in variants:
        start = time.perf_counter()
        lowered, devices = lower_step(v, platform, layers, remat)
        programs[v] = program_key(lowered, devices)
        if programs[v] in known:
          mib[v], seconds[v] = known[programs[v]], None
          continue
        mib[v] = memory.total_memory_bytes(lowered.compile()) / 2**20
        seconds[v] = time.perf_counter() - start
      over = {v: mib[v] / mib["capped"] for v in variants if "capped" in mib}
      rows.append({"platform": platform, "layers": layers, "remat": remat, "MiB": mib,
                   "compile_s": seconds, "over_capped": over, "programs": programs})
  return rows


def known_mib(path: str | None) -> dict[str, float]:
  """MiB per device by program key, of every variant of the rows of the results JSON at
  `path` (an earlier run's: `--reuse`); none for no path."""
  if path is None:
    return {}
  rows = results.read_rows(path, "--reuse", "benchmarks.fallback_memory", "rows")
  known = {key: row["MiB"][v] for row in rows for v, key in row.get("programs", {}).items()}
  if not known:
    print(f"--reuse={path}: no row records its programs (written before they were recorded): "
          "every variant compiles", file=sys.stderr)
  return known


def main():
  launch_platform.setup(cpu_only=True)  # TPU figures: a topology compiled from the CPU
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--platforms", default="cpu,tpu")
  parser.add_argument("--layers", default="0,4,8",
                      help="0 = one bare layer (value and grad); N = N remat layers + Adam")
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--emb_dim", type=int, default=SETTING["emb_dim"])
  parser.add_argument("--mlp_dim", type=int, default=SETTING["mlp_dim"])
  parser.add_argument("--factor", type=float, default=SETTING["ragged_buffer_factor"])
  parser.add_argument("--remat", default="full",
                      choices=[k for k, v in transformer.REMAT_POLICIES.items() if v])
  parser.add_argument("--reuse", help="a results JSON of this benchmark: its variants whose "
                      "program (launch.compiling.program_key) is this run's are read back, not "
                      "compiled")
  results.add_argument(parser, "fallback_memory")
  args = parser.parse_args()
  try:
    known = known_mib(args.reuse)
  except UserError as e:
    parser.error(str(e))
  SETTING.update(emb_dim=args.emb_dim, mlp_dim=args.mlp_dim, ragged_buffer_factor=args.factor)
  variants = args.variants.split(",")
  rows = measure(args.platforms.split(","), [int(n) for n in args.layers.split(",")], variants,
                 args.remat, known)
  results.publish(args.results, {"setting": {**SETTING, "batch": BATCH, "seq": SEQ,
                                             "adaptive_max_chunks": ADAPTIVE_MAX_CHUNKS},
                                 "rows": rows})
  over = [v for v in variants if v != "capped" and "capped" in variants]
  print("\nTotal MiB per device (compile seconds)")
  print("| platform | model | " + " | ".join(variants) + " | " +
        " | ".join(f"{v} / capped" for v in over) + " |")
  print("|---|---|" + "---|" * (len(variants) + len(over)))
  for r in rows:
    model = ("1 layer, bare" if r["layers"] == 0
             else f"{r['layers']} layers, remat '{r['remat']}', + Adam")
    took = {v: "reused" if s is None else f"{s:.0f} s" for v, s in r["compile_s"].items()}
    cells = [f"{r['MiB'][v]:.1f} ({took[v]})" for v in variants]
    cells += [f"{r['over_capped'][v]:.2f}x" for v in over]
    print(f"| {r['platform']} | {model} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  main()
