"""The launcher's throughput with the MoE telemetry on vs off (`config.moe_metrics`, the
layers' fallback events and `config.traffic.record` together).

  python -m benchmarks.trainer_overhead [--rounds=5 --warmup_steps=20 --steps=120]

Each round trains the default config (8 simulated CPU devices) once with the telemetry on and
once off, each from scratch in its own workdir and its own process. On a machine with two or
more cores the two runs of a round go at the same time, each pinned to its own core, and swap
cores every round: both see the same machine at the same moment, which on a shared machine
matters more than anything (runs minutes apart drift by 10-30%; paired rounds spread by about
3%). With one core the two runs alternate order round by round.

Steps/s is measured in the steady state, over `--steps` steps after `--warmup_steps` (so the
compile is left out), from the trainer's own `train/tokens_per_second` points: one per fetched
interval, timed from fetch to fetch, so it covers everything the host does for those steps
(dispatch, the fetch, aggregation, alerts, callbacks, the event files' writes where they hold
the loop up). Eval and checkpoints fall outside the window. The ratio on / off is taken within
a round. JSON, then a table, then a verdict against the goal (on / off >= `--goal`, 0.98): the
median of at least 3 rounds decides; where the rounds' 25th-75th percentile range holds the
goal, the verdict says the machine's noise is as large as the difference.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from typing import Sequence

import numpy as np

from launch.setup import platform, results

MODES = ("on", "off")


def interval_rates(workdir: str) -> dict[int, float]:
  """Last step of each fetched interval -> its `train/tokens_per_second`."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  from tensorboard.util import tensor_util
  acc = EventAccumulator(workdir, size_guidance={"tensors": 0})
  acc.Reload()
  return {e.step: float(tensor_util.make_ndarray(e.tensor_proto))
          for e in acc.Tensors("train/tokens_per_second")}


def steps_per_second(telemetry: bool, warmup: int, steps: int) -> float:
  """Trains the default job in this process; its steps/s over steps [warmup, warmup + steps)."""
  import jax
  from launch.run import trainer
  from launch.setup import settings as settings_lib
  platform.setup(cpu_only=True)
  default = settings_lib.load(os.path.join(settings_lib.CONFIGS, "default.py"))
  # The window [warmup, warmup + steps) starts and ends at fetches; eval and checkpoints
  # (and the final fetch) come after it.
  last = warmup + steps + default.log_every
  # Off: no callbacks and no traffic files either; on: the default job's telemetry (tags,
  # histograms, the expert-load image, alerts, the traffic recording).
  overrides = {"moe_metrics": telemetry, "moe.emit_fallback_events": telemetry,
               "traffic.record": telemetry, "train_steps": last, "eval_every": last,
               "checkpoint_every": last}
  c = settings_lib.load(os.path.join(settings_lib.CONFIGS, "default.py"),
                        [(k, str(v)) for k, v in overrides.items()])
  with tempfile.TemporaryDirectory() as workdir:
    trainer.train_and_evaluate(settings_lib.build(c, jax.device_count()), workdir)
    rates = interval_rates(workdir)
  tokens_per_step = c.data.batch_size * c.data.seq_len
  ends = range(warmup + c.log_every - 1, warmup + steps, c.log_every)
  seconds = sum(c.log_every * tokens_per_step / rates[end] for end in ends)
  return steps / seconds


def _child_command(mode: str, warmup: int, steps: int) -> list[str]:
  return [sys.executable, "-m", "benchmarks.trainer_overhead", f"--child={mode}",
          f"--warmup_steps={warmup}", f"--steps={steps}"]


def run_round(commands: Sequence[Sequence[str]], cores: Sequence[int] | None) -> list[float]:
  """Runs `commands` (each prints its steps/s as its last stdout line): at once, the i-th
  pinned to `cores[i]`, or one after another when `cores` is None."""
  def start(i, command):
    pin = None if cores is None else (lambda core=cores[i]: os.sched_setaffinity(0, {core}))
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, preexec_fn=pin)
  def result(process):
    out = process.communicate()[0]
    if process.returncode:
      raise RuntimeError(f"{' '.join(process.args)} exited with status {process.returncode}")
    return float(out.strip().splitlines()[-1])
  if cores is None:
    return [result(start(i, c)) for i, c in enumerate(commands)]
  return [result(p) for p in [start(i, c) for i, c in enumerate(commands)]]


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
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--warmup_steps", type=int, default=20)
  parser.add_argument("--steps", type=int, default=120)
  parser.add_argument("--goal", type=float, default=0.98, help="on / off must be at least this")
  parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
  results.add_argument(parser, "trainer_overhead")
  args = parser.parse_args()
  if args.child:
    print(steps_per_second(args.child == "on", args.warmup_steps, args.steps))
    return
  from launch.configs import default
  log_every = default.get_config().log_every  # the default job's, as the children train it
  if args.warmup_steps % log_every or args.steps % log_every:
    parser.error(f"--warmup_steps and --steps must be multiples of log_every={log_every}")
  available = sorted(os.sched_getaffinity(0))
  paired = len(available) >= 2
  samples = {mode: [] for mode in MODES}
  for r in range(args.rounds):
    order = MODES if r % 2 == 0 else MODES[::-1]
    cores = available[:2] if paired else None
    rates = run_round([_child_command(m, args.warmup_steps, args.steps) for m in order], cores)
    for mode, rate in zip(order, rates):
      samples[mode].append(rate)
  ratio = np.asarray(samples["on"]) / np.asarray(samples["off"])
  on_over_off = {"median": float(np.median(ratio)), "p25": float(np.percentile(ratio, 25)),
                 "p75": float(np.percentile(ratio, 75))}
  result = {"rounds": args.rounds, "steps": args.steps, "warmup_steps": args.warmup_steps,
            "pairing": ("at once, one core each, swapped every round" if paired
                        else "one after another (one core)"),
            "steps_per_second": samples, "on_over_off_per_round": ratio.round(4).tolist(),
            "on_over_off": on_over_off, "goal": args.goal,
            "verdict": verdict(on_over_off, args.rounds, args.goal)}
  platform.setup(cpu_only=True)  # the machine the JSON names: the children's
  results.publish(args.results, result)
  print("\n| telemetry | steps/s (median) | on / off (median, p25-p75) |")
  print("|---|---|---|")
  r = result["on_over_off"]
  print(f"| off | {np.median(samples['off']):.2f} | - |")
  print(f"| on | {np.median(samples['on']):.2f} | {r['median']:.3f} "
        f"({r['p25']:.3f}-{r['p75']:.3f}) |")
  print(f"\n{result['verdict']}")


if __name__ == "__main__":
  main()
