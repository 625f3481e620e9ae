"""Step time with the MoE metrics pipeline on vs off (8 CPU devices).

  python -m benchmarks.metrics_overhead [--rounds=15 --layers=4]

A scan-free stack of rematerialised MoE layers (the single-layer setting of `fallback_memory`,
balanced routing, fallback enabled) trains one value-and-grad step. "on": the layers get
`step=` and `layer_index=`, so each emits its events through `jax.debug.callback`, and the
host aggregates them, writes TensorBoard scalars/histograms and checks the alert rules after
every step. "off": no `step`, no events. Interleaved rounds; ratio per round. JSON, then a table.
"""
from __future__ import annotations

import argparse
import functools
import json
import tempfile

from benchmarks import fallback_memory, fallback_overhead, timing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import metrics  # noqa: E402
import moe_hk  # noqa: E402


def make_step(config, mesh, layers: int):
  layer = jax.checkpoint(functools.partial(moe_hk.moe_forward, config=config, mesh=mesh),
                         policy=jax.checkpoint_policies.nothing_saveable)
  def loss(params, x, step):
    for i in range(layers):
      y, _ = layer(params, x, step=step, layer_index=None if step is None else i)
      x = x + y
    return jnp.mean(x ** 2)
  return jax.jit(jax.value_and_grad(loss))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--layers", type=int, default=4)
  args = parser.parse_args()
  mesh = fallback_memory.make_mesh("cpu")
  config = fallback_memory.variant_config("fallback_scan", **fallback_overhead.TIMING_WIDTH)
  params, x = fallback_overhead.balanced_inputs(config, fallback_memory.BATCH,
                                                fallback_memory.SEQ)
  step_fn = make_step(config, mesh, args.layers)  # traces once per kind of `step`
  workdir = tempfile.mkdtemp()
  moe_metrics = metrics.MoEMetrics(
      workdir, worst_case_factor=metrics.worst_case_factor(8, 2, 8), flush_on_sigterm=False)
  counter = iter(range(10**9))

  def metrics_on():
    step = next(counter)
    out = step_fn(params, x, step)
    jax.block_until_ready(out)
    moe_metrics.end_step(step)
    return out

  fns = {"metrics_off": lambda: step_fn(params, x, None), "metrics_on": metrics_on}
  summary = timing.ratio_summary(timing.interleaved(fns, args.rounds), "metrics_off")
  moe_metrics.close()
  print(json.dumps({"rounds": args.rounds, "layers": args.layers, "results": summary},
                   indent=2))
  timing.print_table(f"{args.layers} remat MoE layers, value and grad", summary, "metrics_off")


if __name__ == "__main__":
  main()
