"""The launcher's throughput with the MoE telemetry on vs off (`config.moe_metrics`, the
layers' fallback events and `config.traffic.record` together).

  python -m benchmarks.trainer_overhead [--rounds=5 --warmup_steps=20 --steps=60]

Each round trains the default config (8 simulated CPU devices) once with `moe_metrics=True`
and once with `moe_metrics=False`, in alternating order, each from scratch in its own workdir.
Steps/s is measured in the steady state, over `--steps` steps after `--warmup_steps` (so the
compile is left out), from the trainer's own `train/tokens_per_second` points: one per fetched
interval, timed from fetch to fetch, so it covers everything the host does for those steps
(dispatch, the fetch, aggregation, alerts, and the event files' writes where they hold the loop
up). Eval and checkpoints fall outside the window. The ratio on / off is taken within a
round. JSON, then a table, then a verdict against the goal (on / off >= `--goal`, 0.98): the
median of at least 3 rounds decides; where the rounds' 25th-75th percentile range holds the
goal, the verdict says the machine's noise is as large as the difference.
"""
from __future__ import annotations

import argparse
import json
import tempfile

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from launch import platform, trainer
from launch.configs import default


def interval_rates(workdir: str) -> dict[int, float]:
  """Last step of each fetched interval -> its `train/tokens_per_second`."""
  acc = EventAccumulator(workdir, size_guidance={"tensors": 0})
  acc.Reload()
  return {e.step: float(tensor_util.make_ndarray(e.tensor_proto))
          for e in acc.Tensors("train/tokens_per_second")}


def steps_per_second(moe_metrics: bool, warmup: int, steps: int) -> float:
  c = default.get_config()
  # Off: no callbacks and no traffic files either; on: the default job's telemetry (tags,
  # histograms, the expert-load image, alerts, the traffic recording).
  c.moe_metrics = c.moe.emit_fallback_events = c.traffic.record = moe_metrics
  # The window [warmup, warmup + steps) starts and ends at fetches; eval and checkpoints
  # (and the final fetch) come after it.
  c.train_steps = warmup + steps + c.log_every
  c.eval_every = c.checkpoint_every = c.train_steps
  with tempfile.TemporaryDirectory() as workdir:
    trainer.train_and_evaluate(c, workdir)
    rates = interval_rates(workdir)
  tokens_per_step = c.data.batch_size * c.data.seq_len
  ends = range(warmup + c.log_every - 1, warmup + steps, c.log_every)
  seconds = sum(c.log_every * tokens_per_step / rates[end] for end in ends)
  return steps / seconds


def verdict(summary: dict, rounds: int, goal: float) -> str:
  """One line: whether the per-round ratios on / off (`summary`: their median, p25, p75) meet
  `goal`, and how firmly."""
  if rounds < 3:
    return f"no verdict: {rounds} rounds, at least 3 needed"
  median, p25, p75 = summary["median"], summary["p25"], summary["p75"]
  met = "meets" if median >= goal else "misses"
  firm = ("the spread holds the goal: the noise is as large as the difference, more rounds "
          "would tell" if p25 < goal <= p75 else "the spread is clear of the goal")
  return (f"{met} the goal: on / off median {median:.3f} vs {goal} over {rounds} rounds "
          f"(p25-p75 {p25:.3f}-{p75:.3f}; {firm})")


def main():
  platform.setup(cpu_only=True)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--warmup_steps", type=int, default=20)
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--goal", type=float, default=0.98, help="on / off must be at least this")
  args = parser.parse_args()
  log_every = default.get_config().log_every
  if args.warmup_steps % log_every or args.steps % log_every:
    parser.error(f"--warmup_steps and --steps must be multiples of log_every={log_every}")
  samples = {"on": [], "off": []}
  for r in range(args.rounds):
    for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
      samples[mode].append(steps_per_second(mode == "on", args.warmup_steps, args.steps))
  ratio = np.asarray(samples["on"]) / np.asarray(samples["off"])
  on_over_off = {"median": float(np.median(ratio)), "p25": float(np.percentile(ratio, 25)),
                 "p75": float(np.percentile(ratio, 75))}
  result = {"rounds": args.rounds, "steps": args.steps, "warmup_steps": args.warmup_steps,
            "steps_per_second": samples, "on_over_off": on_over_off,
            "goal": args.goal, "verdict": verdict(on_over_off, args.rounds, args.goal)}
  print(json.dumps(result, indent=2))
  print("\n| moe_metrics | steps/s (median) | on / off (median, p25-p75) |")
  print("|---|---|---|")
  r = result["on_over_off"]
  print(f"| False | {np.median(samples['off']):.2f} | - |")
  print(f"| True | {np.median(samples['on']):.2f} | {r['median']:.3f} "
        f"({r['p25']:.3f}-{r['p75']:.3f}) |")
  print(f"\n{result['verdict']}")


if __name__ == "__main__":
  main()
