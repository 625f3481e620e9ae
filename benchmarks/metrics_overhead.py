"""Step time with the MoE metrics on vs off, per route (8 CPU devices).

  python -m benchmarks.metrics_overhead [--rounds=15 --layers=4]

A scan-free stack of rematerialised MoE layers (the single-layer setting of `fallback_memory`,
balanced routing, fallback enabled) trains one value-and-grad step that returns every layer's
stats. Variants, interleaved, ratio per round:

* `metrics_off`: the layers get no `step`: no callbacks; the host does nothing.
* `from_step` (the launcher's route): the layers get `step=` and `layer_index=`, so the
  fallback branch would call back if it ran (`emit_fallback_events`; nothing overflows here);
  the host fetches the returned stats and `MoEMetrics.report_step` aggregates them, writes
  TensorBoard scalars and histograms and runs the alert rules, every step.
* `streamed`: the bare-layer route: `stream_step_stats=True` calls back from
  every layer every step and `MoEMetrics.end_step` waits for the callbacks.

JSON, then a table.
"""
from __future__ import annotations

import argparse
import functools
import tempfile

import jax
import jax.numpy as jnp

import metrics
import moe_hk
from benchmarks import fallback_memory, fallback_overhead, timing
from launch.setup import platform, results
from moe_hk import buffer_size


def make_step(config, mesh, layers: int):
  """jitted `(params, x, step) -> ((loss, stats stacked [layers]), grads)`."""
  layer = jax.checkpoint(functools.partial(moe_hk.moe_forward, config=config, mesh=mesh),
                         policy=jax.checkpoint_policies.nothing_saveable)
  def loss(params, x, step):
    stats = []
    for i in range(layers):
      y, s = layer(params, x, step=step, layer_index=None if step is None else i)
      x = x + y
      stats.append(s)
    return jnp.mean(x ** 2), jax.tree.map(lambda *a: jnp.stack(a), *stats)
  return jax.jit(jax.value_and_grad(loss, has_aux=True))


def main():
  platform.setup(cpu_only=True)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--layers", type=int, default=4)
  results.add_argument(parser, "metrics_overhead")
  args = parser.parse_args()
  mesh = fallback_memory.make_mesh("cpu")
  config = fallback_memory.variant_config("fallback_scan", **fallback_overhead.TIMING_WIDTH)
  params, x = fallback_overhead.balanced_inputs(config, fallback_memory.BATCH,
                                                fallback_memory.SEQ)
  # Each traces once per kind of `step` (None or traced).
  from_step = make_step(config.replace(stream_step_stats=False), mesh,
                        args.layers)
  streamed = make_step(config.replace(stream_step_stats=True), mesh,
                       args.layers)
  workdir = tempfile.mkdtemp()
  moe_metrics = metrics.MoEMetrics(
      workdir, worst_case_factor=buffer_size.worst_case_factor(8, 2, 8), flush_on_sigterm=False)
  counter = iter(range(10**9))

  def on_from_step():
    step = next(counter)
    (loss, stats), grads = from_step(params, x, step)
    moe_metrics.report_step(step, jax.device_get(stats))
    return loss, grads

  def on_streamed():
    step = next(counter)
    out = streamed(params, x, step)
    jax.block_until_ready(out)
    moe_metrics.end_step(step)
    return out

  fns = {"metrics_off": lambda: from_step(params, x, None), "from_step": on_from_step,
         "streamed": on_streamed}
  summary = timing.ratio_summary(timing.interleaved(fns, args.rounds), "metrics_off")
  moe_metrics.close()
  results.publish(args.results, {"rounds": args.rounds, "layers": args.layers,
                                       "results": summary})
  timing.print_table(f"{args.layers} remat MoE layers, value and grad", summary, "metrics_off")


if __name__ == "__main__":
  main()
