"""The default job with the buffer-factor autopilot against fixed factors, in interleaved rounds.

  python -m benchmarks.autopilot_run [--workdir=DIR --steps=400 --rounds=3
      --runs=auto,fixed1.5,fixed2,fixed2.5,fixed3,worst --from_step=100
      --results=autopilot_run]

Trains the default config (8 simulated CPU devices) from scratch once per run and round: the
autopilot from factor 3.0 (`auto`, `config.autopilot`'s defaults: the throughput objective),
fixed factors (`fixedF`) and the worst-case buffer (`worst`, factor -1: nothing overflows).
Round r runs every run once, the order rotated by r, so a slow stretch of the machine does not
fall on one run. Per run and round: tokens/s over steps `--from_step`..`--steps` (the wall time
between the event files' points of those steps: evals, checkpoints and the autopilot's
compiles included, the first compile not), the autopilot's factor schedule, the fallback
frequency, rows dropped, the largest difference of its loss curve from the first fixed
run's, and the factor rule's answer on its recorded traffic (`launch.capacity`'s pick, with
its basis). Then, per run, the median tokens/s over the rounds and their spread, and the
autopilot's median over the best fixed run's. The runs stay in `--workdir`
(`DIR/<run>-r<round>`). JSON, then a table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil

import jax
import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from launch.planning import replay
from launch.run import trainer
from launch.setup import platform, results, settings as settings_lib
from metrics import factor_rule
from metrics.traffic import read_traffic

START = 3.0  # the autopilot's first factor


def factor_of(name: str) -> float | None:
  """The fixed factor a run name asks for (`fixed2.5`: 2.5, `worst`: -1), None for `auto`."""
  if name == "auto":
    return None
  if name == "worst":
    return -1.0
  if name.startswith("fixed"):
    return float(name[len("fixed"):])
  raise ValueError(f"--runs: unknown run {name!r}; valid: auto, worst, fixedF (e.g. fixed2.5).")


def _points(workdir: str, tag: str) -> dict[int, tuple[float, float]]:
  """step -> (wall time, value) of `tag`."""
  acc = EventAccumulator(workdir, size_guidance={"tensors": 0})
  acc.Reload()
  return {e.step: (e.wall_time, float(tensor_util.make_ndarray(e.tensor_proto)))
          for e in acc.Tensors(tag)}


def run(name: str, path: str, steps: int, from_step: int) -> dict:
  fixed = factor_of(name)
  settings = default_settings(train_steps=steps,
                              **{"moe.ragged_buffer_factor": START if fixed is None else fixed,
                                 "autopilot.enabled": fixed is None})
  shutil.rmtree(path, ignore_errors=True)
  losses = trainer.train_and_evaluate(settings, path)
  factors = {s: v for s, (_, v) in _points(path, "moe/ragged_buffer_factor").items()}
  fell_back = _points(path, "learning/moe_dropless_fallback_layers")
  dropped = _points(path, "moe/dropped_rows_fraction")
  times = {s: t for s, (t, _) in _points(path, "train/loss").items()}
  # The points of one fetch share its wall time: time from the fetch holding `from_step - 1`
  # to the last one.
  first, last = from_step - 1, steps - 1
  changes = []
  if os.path.exists(os.path.join(path, "alerts.jsonl")):
    with open(os.path.join(path, "alerts.jsonl")) as f:
      for alert in map(json.loads, f):
        if alert["rule"] == "buffer_factor_changed":
          changes.append({"step": alert["step"], "from": alert["old_factor"],
                          "to": alert["new_factor"], "reason": alert["reason"]})
  tokens = settings.config.data.batch_size * settings.config.data.seq_len
  advice = replay.advise(replay.window(read_traffic(path), 100), rule=factor_rule.Rule())
  return {"run": name, "factor": settings.layer.ragged_buffer_factor, "autopilot": fixed is None,
          "changes": changes, "final_factor": factors[last],
          "planner_pick": advice.factor, "planner_basis": advice.basis,
          "planner_reason": advice.reason,
          "fallback_frequency": float(np.mean([fell_back[s][1] > 0 for s in range(steps)])),
          "max_dropped_rows_fraction": max(v for _, v in dropped.values()),
          "tokens_per_second": tokens * (last - first) / (times[last] - times[first]),
          "losses": losses}


def main():
  platform.setup(cpu_only=True)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default="workdir/autopilot_run")
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--from_step", type=int, default=100)
  parser.add_argument("--runs", default="auto,fixed1.5,fixed2,fixed2.5,fixed3,worst")
  results.add_argument(parser, "autopilot_run")
  args = parser.parse_args()
  names = args.runs.split(",")
  for name in names:
    factor_of(name)  # refuses an unknown name before anything runs
  if not 0 < args.from_step < args.steps:
    parser.error(f"--from_step={args.from_step} must be in (0, --steps={args.steps}).")
  rounds = []
  for r in range(args.rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    done = {n: run(n, os.path.join(args.workdir, f"{n}-r{r}"), args.steps, args.from_step)
            for n in order}
    rounds.append([done[n] for n in names])
  fixed = [n for n in names if n != "auto"]
  reference = rounds[0][names.index(fixed[0])]["losses"] if fixed else None
  for done in rounds:
    for res in done:
      losses = res.pop("losses")
      res["max_loss_difference"] = (float(np.max(np.abs(np.subtract(losses, reference))))
                                    if reference else None)
  median = {n: float(np.median([rd[i]["tokens_per_second"] for rd in rounds]))
            for i, n in enumerate(names)}
  spread = {n: (float(min(rd[i]["tokens_per_second"] for rd in rounds)),
                float(max(rd[i]["tokens_per_second"] for rd in rounds)))
            for i, n in enumerate(names)}
  best = max(fixed, key=median.get) if fixed else None
  summary = {"rounds": rounds, "median_tokens_per_second": median, "spread": spread,
             "best_fixed": best,
             "autopilot_over_best_fixed": (median["auto"] / median[best]
                                           if "auto" in median and best else None)}
  results.publish(args.results, summary)
  print("\n| run | tokens/s (median) | spread over rounds | factor schedule (round 0) | "
        "fallback frequency | dropped rows (max fraction) | max loss difference | the rule's "
        "pick on its traffic (round 0) |")
  print("|---|---|---|---|---|---|---|---|")
  for i, n in enumerate(names):
    r0 = rounds[0][i]
    schedule = " -> ".join([f"{r0['factor']:g}"] + [f"{c['to']:g} ({c['reason']}, step "
                                                     f"{c['step']})" for c in r0["changes"]])
    print(f"| {n} | {median[n]:.0f} | {spread[n][0]:.0f}-{spread[n][1]:.0f} | {schedule} | "
          f"{r0['fallback_frequency']:.2f} | {r0['max_dropped_rows_fraction']:g} | "
          f"{r0['max_loss_difference']:.2g} | {_pick(r0)} |")
  if "auto" in median and best:
    print(f"\nautopilot / best fixed ({best}): {median['auto'] / median[best]:.3f}")


def _pick(run: dict) -> str:
  pick = run["planner_pick"]
  return "none" if pick is None else f"{pick:g} ({run['planner_basis']})"


def default_settings(**overrides) -> settings_lib.Settings:
  """The default job's settings with `overrides` (dotted keys, as on the command line)."""
  config = settings_lib.load(os.path.join(settings_lib.CONFIGS, "default.py"),
                             [(key, str(value)) for key, value in overrides.items()])
  return settings_lib.build(config, jax.device_count())


if __name__ == "__main__":
  main()
