"""Step time of the dropless fallback when a layer overflows: fixed vs adaptive chunking.

  python -m benchmarks.fallback_cost [--rounds=10] [--layers=2]

A value-and-grad step of a scan of residual MoE layers, each under
jax.checkpoint(nothing_saveable) as in training, on 8 CPU devices (8 shards, 16 experts,
top-2, 8 x 256 tokens per shard, factor 1.5: the worst case needs 8 chunks, so adaptive
chunking chooses 2 or 8). Times, interleaved: the capped step on balanced routing
(baseline, nothing overflows), and the fixed and the adaptive fallback under a mild and a
severe overflow (router skewed towards experts 0 and 1). Reports the median and p25-p75 of
per-round ratios to the baseline, and the chunk count each layer ran. JSON, then a table.
"""
from __future__ import annotations

import argparse
import functools
import json

from benchmarks import fallback_overhead, timing  # fallback_overhead sets up 8 CPU devices

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import moe_hk  # noqa: E402

SETTING = dict(num_experts=16, num_experts_per_tok=2, emb_dim=64, mlp_dim=128,
               ragged_buffer_factor=1.5)
BATCH, SEQ = 64, 256
# Router skew towards experts 0 and 1 (logit shift relative to the routing noise): the mild
# one overflows the capped buffer but fits 2 chunks, the severe one needs all 8.
MILD_SKEW, SEVERE_SKEW = 1.0, 4.0
# Expert output scale: keeps the residual stream close to x, so every layer routes (and
# overflows) like the first.
OUTPUT_SCALE = 0.05


def variant_config(chunking: str | None) -> moe_hk.MoEConfig:
  """The capped layer (`None`), or with the `layer` fallback and the given chunking."""
  config = moe_hk.MoEConfig(**SETTING)
  if chunking is None:
    return config
  return config.replace(moe_dropless_fallback="layer", dropless_fallback_chunking=chunking)


def skewed(params: moe_hk.MoEParams, x: jax.Array, skew: float, seed: int = 1):
  """Shifts every token along one direction mu and raises experts 0 and 1's logits along it
  by `skew` router-noise standard deviations. params as `[L, ...]` stacks, x `[B, S, D]`."""
  rng = np.random.default_rng(seed)
  mu = rng.normal(size=x.shape[-1])
  noise = float(jnp.std(x[..., :1, :] @ params.router_w[0]))
  router_w = params.router_w.at[:, :, :2].add(skew * noise * mu[:, None] / (mu @ mu))
  return params._replace(router_w=router_w), x + mu


def stacked_inputs(layers: int):
  """Balanced-routing params stacked `[layers, ...]` and x `[B, S, D]`."""
  params, x = fallback_overhead.balanced_inputs(variant_config(None), BATCH, SEQ)
  params = params._replace(wo=params.wo * OUTPUT_SCALE)
  return jax.tree.map(lambda a: jnp.stack([a] * layers), params), x


def step_fn(config: moe_hk.MoEConfig, mesh):
  """jit(value_and_grad) of a scan of rematerialised residual MoE layers; aux = the layers'
  MoEStats, stacked `[layers]`."""
  layer = jax.checkpoint(functools.partial(moe_hk.moe_forward, config=config, mesh=mesh),
                         policy=jax.checkpoint_policies.nothing_saveable)
  def loss(stacked, x):
    def body(carry, p):
      y, stats = layer(p, carry)
      return carry + y, stats
    out, stats = jax.lax.scan(body, x, stacked)
    return jnp.mean(out ** 2) + jnp.sum(stats.lb_loss), stats
  return jax.jit(jax.value_and_grad(loss, has_aux=True))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--layers", type=int, default=2)
  args = parser.parse_args()
  mesh = moe_hk.make_mesh(expert=8)
  balanced = stacked_inputs(args.layers)
  inputs = {"mild": skewed(*balanced, MILD_SKEW), "severe": skewed(*balanced, SEVERE_SKEW)}
  steps = {name: step_fn(variant_config(name), mesh) for name in ("fixed", "adaptive")}
  fns = {"capped_no_overflow": functools.partial(step_fn(variant_config(None), mesh),
                                                 *balanced)}
  runs = {}
  for overflow, (params, x) in inputs.items():
    for chunking, step in steps.items():
      fns[f"{chunking}_{overflow}"] = functools.partial(step, params, x)
  for name, fn in fns.items():
    (_, stats), _ = fn()
    factors = np.asarray(stats.required_factor, np.float64).round(3)
    runs[name] = {"fallback_chunks": np.asarray(stats.fallback_chunks).tolist(),
                  "required_factor": factors.tolist()}
  assert runs["capped_no_overflow"]["required_factor"][0] <= SETTING["ragged_buffer_factor"]
  assert runs["adaptive_mild"]["fallback_chunks"] == [2] * args.layers, runs
  samples = timing.interleaved(fns, args.rounds)
  summary = timing.ratio_summary(samples, "capped_no_overflow")
  print(json.dumps({"rounds": args.rounds, "layers": args.layers, "setting": SETTING,
                    "tokens": [BATCH, SEQ], "runs": runs, "timing": summary}, indent=2))
  timing.print_table(f"value-and-grad step, {args.layers} remat MoE layers, 8 CPU devices",
                     summary, "capped_no_overflow")
  print("\n| variant | chunks per layer | required factor per layer |\n|---|---|---|")
  for name, run in runs.items():
    print(f"| {name} | {run['fallback_chunks']} | {run['required_factor']} |")


if __name__ == "__main__":
  main()
