"""Step-time cost of the enabled fallback on steps that do not overflow (8 CPU devices).

  python -m benchmarks.fallback_overhead [--rounds=15]

Times a value-and-grad step of the single-layer setting of `fallback_memory` at width 64 /
MLP 128 (`TIMING_WIDTH`: at its memory width of 1024 a CPU step takes tens of seconds), factor 2,
balanced routing so nothing overflows, with `moe_dropless_fallback='none'` and `'layer'`,
bare and with the layer under jax.checkpoint(nothing_saveable) as in training. Rounds are
interleaved; ratios are taken within a round. JSON, then a table.
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import moe_hk
from benchmarks import fallback_memory, timing
from launch.setup import platform, results

TIMING_WIDTH = dict(emb_dim=64, mlp_dim=128)


def balanced_inputs(config, batch, seq, seed=0):
  rng = np.random.default_rng(seed)
  d, f, e = config.emb_dim, config.mlp_dim, config.num_experts
  params = moe_hk.MoEParams(rng.normal(size=(d, e)) * 0.01 / np.sqrt(d),
                            rng.normal(size=(e, d, f)) / np.sqrt(d),
                            rng.normal(size=(e, d, f)) / np.sqrt(d),
                            rng.normal(size=(e, f, d)) / np.sqrt(f))
  x = rng.normal(size=(batch, seq, d))
  return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), (params, x))


def step_fn(config, mesh, remat: bool):
  layer = functools.partial(moe_hk.moe_forward, config=config, mesh=mesh)
  if remat:
    layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)
  def loss(p, x):
    y, stats = layer(p, x)
    return jnp.mean(y ** 2) + stats.lb_loss, stats
  return jax.jit(jax.value_and_grad(loss, has_aux=True))


def main():
  platform.setup(cpu_only=True)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=15)
  results.add_argument(parser, "fallback_overhead")
  args = parser.parse_args()
  mesh = fallback_memory.make_mesh("cpu")
  capped = fallback_memory.variant_config("capped", **TIMING_WIDTH)
  with_fallback = fallback_memory.variant_config("fallback_scan", **TIMING_WIDTH)
  params, x = balanced_inputs(capped, fallback_memory.BATCH, fallback_memory.SEQ)
  fns = {}
  for remat in (False, True):
    tag = "remat" if remat else "bare"
    for name, config in (("capped", capped), ("fallback", with_fallback)):
      fn = step_fn(config, mesh, remat)
      (_, stats), _ = fn(params, x)
      assert int(stats.would_drop_rows) == 0 and int(stats.fallback) == 0, stats
      fns[f"{name}_{tag}"] = functools.partial(fn, params, x)
  samples = timing.interleaved(fns, args.rounds)
  result = {"rounds": args.rounds, "setting": {**fallback_memory.SETTING, **TIMING_WIDTH},
            "tokens": [fallback_memory.BATCH, fallback_memory.SEQ]}
  for tag in ("bare", "remat"):
    pair = {k: samples[k] for k in (f"capped_{tag}", f"fallback_{tag}")}
    summary = timing.ratio_summary(pair, f"capped_{tag}")
    result[tag] = summary
    timing.print_table(f"no-overflow step, {tag}", summary, f"capped_{tag}")
  results.publish(args.results, result)


if __name__ == "__main__":
  main()
