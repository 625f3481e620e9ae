"""The default job with the buffer-factor autopilot against fixed factors.

  python -m benchmarks.autopilot_run [--workdir=DIR --steps=200 --runs=auto3,fixed3,fixed2]

Trains the default config (8 simulated CPU devices) three times, from scratch: the autopilot
from factor 3.0 (`auto3`), and fixed factors 3.0 (`fixed3`) and 2.0 (`fixed2`). Reports per
run: the factor over time (its changes), the fallback frequency over the run (steps whose
fallback ran), steps/s in the steady state (from the event files' wall times between the
fetches after step 20 and the last before the end, so the first compile is left out; the
autopilot's candidate compiles run in the background inside that window), each program's
per-device memory (from the compiler: the autopilot's alerts carry its candidates';
`launch.capacity --aot_config` gives any factor's), and the final loss. The runs stay in
`--workdir` (`DIR/<run>`), so `python -m launch.capacity --workdir=DIR/auto3` can replay their
traffic. JSON, then a table.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from launch import platform, trainer
from launch.configs import default

RUNS = {"auto3": (3.0, True), "fixed3": (3.0, False), "fixed2": (2.0, False)}
WARMUP = 20


def _points(workdir: str, tag: str) -> dict[int, tuple[float, float]]:
  """step -> (wall time, value) of `tag`."""
  acc = EventAccumulator(workdir, size_guidance={"tensors": 0})
  acc.Reload()
  return {e.step: (e.wall_time, float(tensor_util.make_ndarray(e.tensor_proto)))
          for e in acc.Tensors(tag)}


def run(name: str, workdir: str, steps: int) -> dict:
  factor, auto = RUNS[name]
  c = default.get_config()
  c.train_steps = steps
  c.moe.ragged_buffer_factor = factor
  c.autopilot.enabled = auto
  path = os.path.join(workdir, name)
  losses = trainer.train_and_evaluate(c, path)
  factors = {s: v for s, (_, v) in _points(path, "moe/ragged_buffer_factor").items()}
  fell_back = {s: v for s, (_, v) in _points(path, "learning/moe_dropless_fallback_layers").items()}
  times = {s: t for s, (t, _) in _points(path, "train/loss").items()}
  last = max(s for s in times if (s + 1) % c.log_every == 0 and s + 1 < steps)
  changes, memory = [], {}
  if os.path.exists(os.path.join(path, "alerts.jsonl")):
    with open(os.path.join(path, "alerts.jsonl")) as f:
      for alert in map(json.loads, f):
        if alert["rule"] == "buffer_factor_changed":
          d = alert["details"]
          changes.append({"step": alert["step"], "from": d["old_factor"], "to": d["new_factor"],
                          "reason": d["reason"]})
          memory[d["new_factor"]] = d["evidence"]["memory_bytes_per_device"]
  return {"run": name, "start_factor": factor, "autopilot": auto, "changes": changes,
          "final_factor": factors[steps - 1],
          "fallback_frequency": float(np.mean([fell_back[s] > 0 for s in range(steps)])),
          "fallback_frequency_last_100": float(np.mean(
              [fell_back[s] > 0 for s in range(max(0, steps - 100), steps)])),
          "steps_per_second": (last - (WARMUP - 1)) / (times[last] - times[WARMUP - 1]),
          "candidate_memory_bytes_per_device": memory, "final_loss": losses[-1]}


def main():
  platform.setup(cpu_only=True)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default="workdir/autopilot_run")
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--runs", default=",".join(RUNS))
  args = parser.parse_args()
  results = [run(name, args.workdir, args.steps) for name in args.runs.split(",")]
  print(json.dumps(results, indent=2))
  print("\n| run | factor over time | fallback frequency (all / last 100 steps) | steps/s | "
        "final loss |")
  print("|---|---|---|---|---|")
  for r in results:
    path = " -> ".join([f"{r['start_factor']:g}"] + [f"{c['to']:g} (step {c['step']})"
                                                    for c in r["changes"]])
    print(f"| {r['run']} | {path} | {r['fallback_frequency']:.2f} / "
          f"{r['fallback_frequency_last_100']:.2f} | {r['steps_per_second']:.2f} | "
          f"{r['final_loss']:.3f} |")


if __name__ == "__main__":
  main()
