"""Replays a run's recorded MoE traffic at candidate buffer factors and names the one to use.

  python -m launch.capacity --workdir=DIR [--factors=1,1.25,1.5,2,3] [--window=100]
      [--expert_shards=P] [--format=table|json]
      [--aot_config=PATH --compile_topology=TOPO [--aot_config.KEY=V ...] [--memory_budget_gib=G]]
      [--time_config=PATH [--time_config.KEY=V ...]]

The evidence is the last `--window` recorded steps (WORKDIR/traffic/, `metrics.traffic`; 0: all
of them; the default is the window the run's alerts and autopilot weigh) and the run's timed
intervals. For each `ragged_buffer_factor` (default: 1,1.25,1.5,2,3, the run's own, the
factors it timed and the pick) the capped buffer of R rows per receiving shard is replayed on
every step and MoE layer:

  fallback_frequency       fraction of steps with >= 1 overflowing layer: the fallback would run
  overflowing_layers_mean  overflowing MoE layers per step, averaged over the steps
  would_drop_fraction      rows beyond the buffers / routed rows: dropped without a fallback
  buffer_rows              R per receiving shard
  expert_shards            P, the expert-parallel size the traffic is grouped for
  memory_bytes_per_device  (with --aot_config) the config's train step, capped + `layer`
                           fallback, compiled by `launch.aot` for --compile_topology
  step_seconds             seconds per step measured at the factor, step_seconds_se its
                           standard error (null when not known: one interval), and `basis`:
                           'measured' (the run's own clean intervals at it, fallbacks
                           included), 'timed' (with --time_config: a capped step of that config
                           timed here), null (never timed: no price)
  relative_step_time       step_seconds over the factor in force's (same basis)
  pick                     whether this is the factor the rule names

The pick is the rule the alerts, the recommendation tag and the autopilot follow
(`metrics.factor_rule`, with their defaults): the smallest factor that falls back on at most
--target_fallback_frequency of the steps, unless a measured factor is faster than it beyond
the noise (and falls back on at most --max_fallback_frequency). The last line says which, or
why none; the pick is always a row of the table. With --format=json the output is one object:
`pick`, `reason`, `basis`, `window_steps`, `rows`, and the `command`, `commit`, `date` and
`machine`.

--time_config is the run's own config (its shapes must be the run's); it compiles and runs
one capped program per factor here, printing its progress, and prices the factors by those
times instead of the run's intervals (without --factors it times the default rows, the run's
factor and the rule's unpriced pick). It wants the machine the run trained on, idle, and
cannot go with --compile_topology (run the two separately).

`--expert_shards` regroups the same devices (same tokens per device) into expert groups of that
size (unpriced: the timings are the recorded size's). Writes WORKDIR/capacity.png. Traffic
files it cannot use are skipped, a warning each; the table's first line counts them.
"""
import json
import os
import sys
from typing import Sequence

import jax
import ml_collections
from absl import app, flags

from launch.compiling import topology as topology_lib
from launch.planning import capacity_report as report, replay
from launch.setup import cli, platform, results as results_lib, settings as settings_lib
from launch.setup.errors import user_errors
from metrics import factor_rule
from metrics.traffic import Traffic, read_traffic
from moe_hk import buffer_size

_WORKDIR = flags.DEFINE_string("workdir", None, "Workdir of a launch.train run (its traffic/).",
                               required=True)
_FACTORS = flags.DEFINE_list("factors", None, "Buffer factors to replay (and to pick from); "
                             f"default {','.join(f'{f:g}' for f in replay.DEFAULT_FACTORS)}, "
                             "the run's own and the pick among multiples of 1/8.")
_WINDOW = flags.DEFINE_integer("window", 100, "The recorded steps to weigh: the last this many "
                               "(the run's alerts and autopilot weigh config.autopilot.window, "
                               "100 by default); 0: all.")
_MAX_FREQUENCY = flags.DEFINE_float("max_fallback_frequency", 0.5, "No faster measured factor "
                                    "that falls back on more than this share is picked.")
_TARGET = flags.DEFINE_float("target_fallback_frequency", 0.01, "The frequency rule: the "
                             "smallest factor that falls back on at most this share.")
_MIN_STEPS = flags.DEFINE_integer("min_steps", 20, "Below this many steps of evidence the rule "
                                  "names no factor (the run's config.autopilot.min_steps).")
_EXPERT_SHARDS = flags.DEFINE_integer("expert_shards", None, "Expert-parallel size to regroup "
                                      "the traffic for; default: the run's.")
_FORMAT = flags.DEFINE_enum("format", "table", ["table", "json"], "Markdown table or one JSON "
                            "object (pick, reason, rows).")
_BUDGET = flags.DEFINE_float("memory_budget_gib", 0.0, "With --aot_config: the pick must fit "
                             "this many GiB per device (0: no budget).")
_AOT_CONFIG = cli.define_config(
    "aot_config", None, "With --compile_topology (a launch.aot topology): also compile this "
    "config's train step per factor and report its memory per device.")
_TIME_CONFIG = cli.define_config(
    "time_config", None, "The run's config: time its capped train step per factor on this "
    "machine's devices, and price the factors by those times ('timed').")
_TIME_STEPS = flags.DEFINE_integer("time_steps", 5, "With --time_config: steps per timed burst.")
_TIME_ROUNDS = flags.DEFINE_integer("time_rounds", 10, "With --time_config: bursts per factor.")
_TOPOLOGY = topology_lib.topology_flag(None, "With --aot_config: the topology to compile for, "
                                       "as launch.aot takes it ('v5p-N', 'v5p:AxBxC', 'cpu:N').")


def memory_per_factor(config: ml_collections.ConfigDict, topology: str,
                      factors: Sequence[float], expert_shards: int,
                      traffic: Traffic) -> list[int]:
  """Per-device bytes of `config`'s train step with a `layer` fallback, one figure per factor.

  The mesh gets `expert_shards` on its expert axis; fsdp takes up the rest of the devices.
  """
  # Loaded only when a compile is asked for.
  from launch.compiling import programs, variants
  devices = topology_lib.topology_devices(topology)
  data = config.mesh.data
  fsdp, rest = divmod(len(devices), data * expert_shards)
  if rest:
    raise ValueError(f"config.mesh.data={data} x expert={expert_shards} does not divide "
                     f"the {len(devices)} devices of --compile_topology={topology}.")
  settings = settings_lib.build(config, len(devices),
                                mesh={"data": data, "fsdp": fsdp, "expert": expert_shards})
  replay.check_routing(settings.layer, traffic, "aot_config")
  return [variants.compile_variant(programs.at_factor(settings, f), devices,
                                   "fallback_scan")["total_bytes"] for f in factors]


def capped_times(config: ml_collections.ConfigDict, traffic: Traffic, factors: Sequence[float],
                 expert_shards: int, steps: int, rounds: int) -> dict[float, factor_rule.Price]:
  """Prices ('timed'): a capped step of `config` (the run's, checked against the traffic) at
  each of `factors` and the run's newest factor, on this machine's devices
  (`launch.compiling.capped_timing`), with a progress line per factor on stderr."""
  from launch.compiling import capped_timing  # compiles and runs: only when asked for
  settings = settings_lib.build(config, jax.device_count())
  replay.check_routing(settings.layer, traffic, "time_config")
  tokens = config.data.batch_size * config.data.seq_len // jax.device_count()
  recorded = (traffic.expert_shards, traffic.tokens_per_device, traffic.expert_shards)
  if (settings.expert_shards, tokens, expert_shards) != recorded:
    raise ValueError(
        f"--time_config runs P={settings.expert_shards} expert shards with T={tokens} tokens "
        f"per device and prices P={expert_shards}; the run recorded P={traffic.expert_shards}, "
        f"T={traffic.tokens_per_device}: pass the run's config and its expert-parallel size.")
  timed = capped_timing.capped_step_seconds(
      settings, [*factors, float(traffic.factors[-1])], steps=steps, rounds=rounds,
      progress=lambda line: print(f"--time_config: {line}", file=sys.stderr, flush=True))
  worst = buffer_size.worst_case_factor(traffic.counts.shape[-1], traffic.k,
                                       traffic.expert_shards)
  return {buffer_size.factor_in_force(f, worst): factor_rule.Price(s, se, "timed")
          for f, (s, se) in timed.items()}


def _check_flags(topology: str | None) -> None:
  """The flag combinations that cannot work: one line, exit status 2."""
  misuse = lambda message: app.UsageError(message, exitcode=cli.FLAG_MISUSE)
  if _BUDGET.value < 0:
    raise misuse(f"--memory_budget_gib={_BUDGET.value:g} must be >= 0 (0: no budget).")
  if _BUDGET.value and topology is None:
    raise misuse(f"--memory_budget_gib={_BUDGET.value:g} needs the compiled memory it is "
                 "compared with: add --aot_config=CFG --compile_topology=TOPO.")
  if (_AOT_CONFIG.value is None) != (topology is None):
    raise misuse("--aot_config and --compile_topology go together (e.g. "
                 "--aot_config=launch/configs/tiny.py --compile_topology=cpu:8).")
  if _TIME_CONFIG.value is not None and topology:
    raise misuse("--time_config times on this machine's devices and --compile_topology "
                 "compiles for another: run them separately.")
  if min(_TIME_STEPS.value, _TIME_ROUNDS.value) < 1:
    raise misuse(f"--time_steps={_TIME_STEPS.value} and --time_rounds={_TIME_ROUNDS.value} "
                 "must be >= 1.")
  if (_WINDOW.value < 0 or _MIN_STEPS.value < 1 or not 0 < _MAX_FREQUENCY.value <= 1 or
      not 0 < _TARGET.value < 1):
    raise misuse(f"--window={_WINDOW.value} must be >= 0, --min_steps={_MIN_STEPS.value} >= 1, "
                 f"--max_fallback_frequency={_MAX_FREQUENCY.value:g} in (0, 1] and "
                 f"--target_fallback_frequency={_TARGET.value:g} in (0, 1).")


def _answer(traffic: Traffic, shards: int, topology: str | None, rule: factor_rule.Rule):
  """(rows, the rule's advice, the factors the run ran): the replay of the table's factors,
  priced by the run's intervals or, with --time_config, by capped steps timed here."""
  factors = replay.factor_list(_FACTORS.value, traffic)
  memory = (dict(zip(factors, memory_per_factor(_AOT_CONFIG.value, topology, factors, shards,
                                                traffic))) if topology else None)
  budget = _BUDGET.value * report.GIB if _BUDGET.value else None
  prices = None
  if _TIME_CONFIG.value is not None:
    if not _FACTORS.value:  # the rule's unpriced answer gets timed too
      first = replay.advise(traffic, rule=rule, expert_shards=shards, prices={})
      factors = sorted({*factors, *([] if first.factor is None else [first.factor])})
    prices = capped_times(_TIME_CONFIG.value, traffic, factors, shards, _TIME_STEPS.value,
                          _TIME_ROUNDS.value)
  # Compiled memory exists for the table's factors only: the pick is then among them.
  advice = replay.advise(traffic, rule=rule, expert_shards=shards, prices=prices,
                         factors=factors if _FACTORS.value or memory else None,
                         fits=lambda f: budget is None or memory[f] <= budget)
  priced = [r.factor for r in advice.rows if r.price is not None]
  shown = sorted({*factors, *priced, *([] if advice.factor is None else [advice.factor])})
  results = replay.plan(traffic, shown, shards)
  for r in results:
    if memory:
      r["memory_bytes_per_device"] = memory[r["factor"]]
  report.annotate(results, advice)
  return results, advice, set(traffic.factors.tolist()) & set(shown)


def main(argv):
  del argv  # launch.setup.cli refuses arguments that are not flags
  topology = _TOPOLOGY.value if flags.FLAGS["compile_topology"].present else None
  _check_flags(topology)
  timing = _TIME_CONFIG.value
  with user_errors():
    # The replay needs no accelerator (a run may hold it) and a compile is launch.aot's, for a
    # topology, from the CPU: both take the CPU. Timing takes the run's own devices.
    if timing is None:
      platform.setup(1 if topology is None else topology_lib.cpu_device_count(topology),
                     cpu_only=True)
    else:
      platform.setup(settings_lib.cpu_devices(timing))
    traffic = replay.window(read_traffic(_WORKDIR.value), _WINDOW.value)
    shards = _EXPERT_SHARDS.value or traffic.expert_shards
    rule = factor_rule.Rule(_TARGET.value, _MAX_FREQUENCY.value, min_steps=_MIN_STEPS.value)
    results, advice, run_factors = _answer(traffic, shards, topology, rule)
  path = os.path.join(_WORKDIR.value, "capacity.png")
  title = report.describe(traffic, shards, _WINDOW.value)
  report.plot(results, run_factors, advice, title, path)
  if _FORMAT.value == "json":
    print(json.dumps(results_lib.record({
        "pick": advice.factor, "reason": advice.reason, "basis": advice.basis,
        "window_steps": advice.steps, "rows": results}), indent=2))
  else:
    print(f"{title}\n\n{report.table(results, run_factors)}\n\n{report.pick_line(advice)}"
          f"\nplot: {path}")


if __name__ == "__main__":
  cli.run(main)
