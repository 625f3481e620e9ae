"""Step time of the dropless fallback when layers overflow, against its proportional ideal.

  python -m benchmarks.fallback_cost [--rounds=7] [--layers=2]

The issue's setting: 8 CPU devices, 8 expert shards, 16 experts, top-2, width 256 (MLP 512),
factor 1.5, 8 x 256 tokens per shard; a value-and-grad step of a scan of residual MoE layers,
each under jax.checkpoint(nothing_saveable) as in training. Two overflows, a mild one (required
factor about 1.2 x the factor) and a severe one (about 2.4 x), set by skewing the router towards
experts 0 and 1 (both on shard 0) until the first layer's required factor hits the target.
For each, timed interleaved: the capped step on the same input (rows dropped; the baseline),
fixed chunking (8 chunks, each with its worst-case buffer) and adaptive chunking
(`fallback.traffic_ladder`). The ideal of a step is the mean over its layers of
max(1, required_factor / factor) capped steps. Reports the median and p25-p75 of per-round
ratios to the capped step, ratio / ideal, the chunks each layer ran and the buffer rows per
chunk of the first layer's rung. JSON, then a table.
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import moe_hk
from benchmarks import fallback_overhead, timing
from launch.setup import platform, results
from moe_hk import buffer_size, fallback, routing

SETTING = dict(num_experts=16, num_experts_per_tok=2, emb_dim=256, mlp_dim=512,
               ragged_buffer_factor=1.5, moe_dropless_fallback="none")  # capped: drops rows
BATCH, SEQ, SHARDS = 64, 256, 8
# Required factor over the buffer factor of each overflow.
OVERFLOWS = {"mild": 1.2, "severe": 2.4}
VARIANTS = ("capped", "fixed", "adaptive")
# Expert output scale: keeps the residual stream close to x, so every layer routes (and
# overflows) like the first.
OUTPUT_SCALE = 0.05


def variant_layer(variant: str, mesh):
  """`(params, x) -> (y, MoEStats)` of one layer as `variant`."""
  config = moe_hk.MoEConfig(**SETTING)
  if variant == "capped":
    return functools.partial(moe_hk.moe_forward, config=config, mesh=mesh)
  config = config.replace(moe_dropless_fallback="layer",
                          dropless_fallback_chunking="fixed" if variant == "fixed" else
                          "adaptive")
  return functools.partial(moe_hk.moe_forward, config=config, mesh=mesh)


def skewed(params: moe_hk.MoEParams, x: jax.Array, skew: float, seed: int = 1):
  """Shifts every token along one direction mu, and raises experts 0 and 1's logits along it
  by `skew` router-noise standard deviations (mu is first projected out of the router, so
  the shift alone changes no logit). params as `[layers, ...]` stacks, x `[B, S, D]`."""
  mu = np.random.default_rng(seed).normal(size=x.shape[-1])
  unit = mu / (mu @ mu)
  router_w = params.router_w - unit[:, None] * (mu @ params.router_w)[..., None, :]
  noise = float(jnp.std(x[..., :1, :] @ router_w[0]))
  router_w = router_w.at[:, :, :2].add(skew * noise * unit[:, None])
  return params._replace(router_w=router_w), x + mu


def skew_for(params, x, target: float, mesh, steps: int = 24) -> float:
  """The skew at which the first layer's required factor is `target` (bisection; the
  required factor grows with the skew)."""
  layer = jax.jit(variant_layer("capped", mesh))
  def required(skew):
    p, xx = skewed(params, x, skew)
    return float(layer(jax.tree.map(lambda a: a[0], p), xx)[1].required_factor)
  low, high = 0.0, 8.0
  for _ in range(steps):
    mid = (low + high) / 2
    low, high = (mid, high) if required(mid) < target else (low, mid)
  return high


def stacked_inputs(layers: int):
  """Balanced-routing params stacked `[layers, ...]` and x `[B, S, D]`."""
  params, x = fallback_overhead.balanced_inputs(moe_hk.MoEConfig(**SETTING), BATCH, SEQ)
  params = params._replace(wo=params.wo * OUTPUT_SCALE)
  return jax.tree.map(lambda a: jnp.stack([a] * layers), params), x


def step_fn(layer):
  """jit(value_and_grad) of a scan of rematerialised residual MoE layers; aux = the layers'
  MoEStats, stacked `[layers]`."""
  layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)
  def loss(stacked, x):
    def body(carry, p):
      y, stats = layer(p, carry)
      return carry + y, stats
    out, stats = jax.lax.scan(body, x, stacked)
    return jnp.mean(out ** 2) + jnp.sum(stats.lb_loss), stats
  return jax.jit(jax.value_and_grad(loss, has_aux=True))


def first_layer_rung(variant: str, params, x) -> fallback.Rung:
  """The rung (chunks, rows per chunk) the first layer of `variant` runs; the capped layer is
  `Rung(1, R)`. Adaptive rungs come from the layer's routing on each shard's batch block."""
  config = moe_hk.MoEConfig(**SETTING)
  k, e = config.num_experts_per_tok, config.num_experts
  batch, tokens = BATCH // SHARDS, BATCH // SHARDS * SEQ
  rows = buffer_size.buffer_rows(SHARDS, tokens, k, e // SHARDS, config.ragged_buffer_factor)
  plan = dict(capped_rows=rows, worst_rows=buffer_size.worst_case_rows(
      SHARDS, tokens, k, e // SHARDS), max_chunks=fallback.fallback_num_chunks(
          batch=batch, seq=SEQ, k=k, shards=SHARDS, local_experts=e // SHARDS, rows=rows))
  if variant == "capped":
    return fallback.Rung(1, rows)
  if variant == "fixed":
    return fallback.fixed_rung(**plan)
  rungs = (fallback.Rung(1, rows), *fallback.traffic_ladder(seq=SEQ, **plan))
  fine = []
  for block in jnp.split(x, SHARDS):  # shard i holds the i-th block of the batch
    ids = routing.route(block.reshape(tokens, -1), params.router_w[0], k).expert_ids
    fine.append(fallback.chunk_counts(ids.reshape(batch, SEQ, k),
                                      fallback.finest_chunks(rungs), e))
  return rungs[int(fallback.first_fit(fallback.rung_overflows(jnp.stack(fine), rungs)))]


def main():
  platform.setup(cpu_only=True)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--layers", type=int, default=2)
  results.add_argument(parser, "fallback_cost")
  args = parser.parse_args()
  mesh = moe_hk.make_mesh(expert=SHARDS)
  factor = SETTING["ragged_buffer_factor"]
  balanced = stacked_inputs(args.layers)
  steps = {v: step_fn(variant_layer(v, mesh)) for v in VARIANTS}
  fns, cases = {}, {}
  for overflow, target in OVERFLOWS.items():
    skew = skew_for(*balanced, target * factor, mesh)
    params, x = skewed(*balanced, skew)
    case = {"skew": skew, "variants": {}}
    for variant, step in steps.items():
      (_, stats), _ = step(params, x)
      rung = first_layer_rung(variant, params, x)
      run = {"fallback_chunks": np.asarray(stats.fallback_chunks).tolist(),
             "dropped_rows": np.asarray(stats.dropped_rows).tolist(),
             "first_layer_rung": rung._asdict()}
      if variant == "capped":
        assert min(run["dropped_rows"]) > 0, run  # the case really overflows
      else:
        assert run["dropped_rows"] == [0] * args.layers, run
        assert run["fallback_chunks"][0] == rung.chunks, run
        # The dropless variants route every layer alike: their required factors.
        case["required_factor"] = np.asarray(stats.required_factor, np.float64).tolist()
      case["variants"][variant] = run
      fns[f"{overflow}/{variant}"] = functools.partial(step, params, x)
    case["ideal"] = float(np.mean(np.maximum(1, np.asarray(case["required_factor"]) / factor)))
    cases[overflow] = case
  samples = timing.interleaved(fns, args.rounds)
  for overflow, case in cases.items():
    names = {f"{overflow}/{v}": v for v in VARIANTS}
    summary = timing.ratio_summary({n: samples[n] for n in names}, f"{overflow}/capped")
    for name, variant in names.items():
      s = summary[name]
      case["variants"][variant].update(s, ratio_over_ideal=s["ratio_median"] / case["ideal"])
  results.publish(args.results, {"rounds": args.rounds, "layers": args.layers,
                                    "setting": SETTING, "tokens": [BATCH, SEQ], "shards": SHARDS,
                                    "cases": cases})
  print(f"\nvalue-and-grad step, {args.layers} remat MoE layers, 8 CPU devices, "
        f"{args.rounds} interleaved rounds")
  print("| overflow | required factor | ideal | variant | chunks per layer | rows per chunk "
        "(layer 0) | median ms | ratio to capped (p25-p75) | ratio / ideal |")
  print("|---|---|---|---|---|---|---|---|---|")
  for overflow, case in cases.items():
    for variant, run in case["variants"].items():
      print(f"| {overflow} | {', '.join(f'{r:.2f}' for r in case['required_factor'])} | "
            f"{case['ideal']:.2f} | {variant} | {run['fallback_chunks']} | "
            f"{run['first_layer_rung']['rows']} | {run['median_s'] * 1e3:.0f} | "
            f"{run['ratio_median']:.2f} ({run['ratio_p25']:.2f}-{run['ratio_p75']:.2f}) | "
            + ("- |" if variant == "capped" else f"{run['ratio_over_ideal']:.2f} |"))


if __name__ == "__main__":
  main()
