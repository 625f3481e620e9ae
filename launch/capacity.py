"""Replays a run's recorded MoE traffic at candidate buffer factors and names the one to use.

  python -m launch.capacity --workdir=DIR [--factors=1,1.25,1.5,2,3] [--window=100]
      [--expert_shards=P] [--format=table|json]
      [--aot_config=PATH --compile_topology=TOPO [--aot_config.KEY=V ...] [--memory_budget_gib=G]]
      [--time_config=PATH [--time_config.KEY=V ...]]

The evidence is the last `--window` recorded steps (WORKDIR/traffic/, `metrics.traffic`; 0: all
of them; the default is the window the run's alerts and autopilot weigh) and the run's timed
intervals. For each `ragged_buffer_factor` (default: 1,1.25,1.5,2,3, the run's own and the
pick) the capped buffer of R rows per receiving shard is replayed on every step and MoE layer:

  fallback_frequency       fraction of steps with >= 1 overflowing layer: the fallback would run
  overflowing_layers_mean  overflowing MoE layers per step, averaged over the steps
  would_drop_fraction      rows beyond the buffers / routed rows: dropped without a fallback
  buffer_rows              R per receiving shard
  expert_shards            P, the expert-parallel size the traffic is grouped for
  memory_bytes_per_device  (with --aot_config) the config's train step, capped + `layer`
                           fallback, compiled by `launch.aot` for --compile_topology
  step_seconds             (when the run timed its steps) predicted seconds per step:
                           `launch.planning.step_model`'s model of the run's timed intervals,
                           with the fallback chunks replayed at the factor; step_seconds_se its
                           standard error (null when not known: one timed interval)
  relative_step_time       step_seconds over the factor in force's (the run's newest)
  capped_step_seconds      (with --time_config) one capped step of that config at the factor,
                           timed on this machine's devices (`launch.planning.capped_timing`):
                           it scales the run's measured step to the factors the run did not
                           train at, in place of the matmul FLOPs (which overstate a bigger
                           buffer's cost where the grouped matmul skips its empty rows)
  pick                     whether this is the factor the rule names

The pick is the rule the alerts and the autopilot follow (`metrics.factor_advice`), with their
defaults for --max_fallback_frequency and --target_fallback_frequency: priced by the run's
timings, the fastest factor that falls back on at most the maximum share of steps, when its
gain over the factor in force is larger than its error; unpriced, the smallest factor that
falls back on at most the target share. The last line says which, or why none. --factors
(or a compiled memory budget) restricts the candidates to the rows.

--time_config is the run's own config (its shapes must be the run's); it compiles and runs
one program per factor here (without --factors: the default rows and the factor the run's own
evidence names or says to time), so it wants the machine the run trained on, idle, and cannot
go with --compile_topology (run the two separately).

`--expert_shards` regroups the same devices (same tokens per device) into expert groups of that
size (unpriced: the timings are the recorded size's). Prints a markdown table, or a JSON list
with --format=json; writes WORKDIR/capacity.png. Traffic files it cannot use are skipped, a
warning each; the table's first line counts them.
"""
import json
import os
import sys
from typing import Sequence

import jax
import ml_collections
from absl import app, flags

from launch import cli, platform, settings as settings_lib
from launch.compiling import topology as topology_lib
from launch.errors import user_errors
from launch.planning import capacity_report as report, replay
from metrics.traffic import Traffic, read_traffic

_WORKDIR = flags.DEFINE_string("workdir", None, "Workdir of a launch.train run (its traffic/).",
                               required=True)
_FACTORS = flags.DEFINE_list("factors", None, "Buffer factors to replay (and to pick from); "
                             f"default {','.join(f'{f:g}' for f in replay.DEFAULT_FACTORS)}, "
                             "the run's own and the pick among multiples of 1/8.")
_WINDOW = flags.DEFINE_integer("window", 100, "The recorded steps to weigh: the last this many "
                               "(the run's alerts and autopilot weigh config.autopilot.window, "
                               "100 by default); 0: all.")
_MAX_FREQUENCY = flags.DEFINE_float("max_fallback_frequency", 0.5, "No factor that falls back on "
                                    "more than this share of the steps is picked (priced).")
_TARGET = flags.DEFINE_float("target_fallback_frequency", 0.01, "Unpriced, the pick is the "
                             "smallest factor that falls back on at most this share.")
_EXPERT_SHARDS = flags.DEFINE_integer("expert_shards", None, "Expert-parallel size to regroup "
                                      "the traffic for; default: the run's.")
_FORMAT = flags.DEFINE_enum("format", "table", ["table", "json"], "Markdown table or JSON list.")
_BUDGET = flags.DEFINE_float("memory_budget_gib", 0.0, "With --aot_config: the pick must fit "
                             "this many GiB per device (0: no budget).")
_AOT_CONFIG = cli.define_config(
    "aot_config", None, "With --compile_topology (a launch.aot topology): also compile this "
    "config's train step per factor and report its memory per device.")
_TIME_CONFIG = cli.define_config(
    "time_config", None, "The run's config: time its capped train step per factor on this "
    "machine's devices, and price the factors from those times.")
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
  from launch.compiling import variants
  from launch.planning import programs
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
                 expert_shards: int, steps: int, rounds: int) -> dict[float, float]:
  """Seconds of a capped step of `config` (the run's, checked against the traffic) at each of
  `factors` and the run's newest factor, on this machine's devices
  (`launch.planning.capped_timing`)."""
  from launch.planning import capped_timing  # compiles and runs: only when asked for
  settings = settings_lib.build(config, jax.device_count())
  replay.check_routing(settings.layer, traffic, "time_config")
  tokens = config.data.batch_size * config.data.seq_len // jax.device_count()
  recorded = (traffic.expert_shards, traffic.tokens_per_device, traffic.expert_shards)
  if (settings.expert_shards, tokens, expert_shards) != recorded:
    raise ValueError(
        f"--time_config runs P={settings.expert_shards} expert shards with T={tokens} tokens "
        f"per device and prices P={expert_shards}; the run recorded P={traffic.expert_shards}, "
        f"T={traffic.tokens_per_device}: pass the run's config and its expert-parallel size.")
  return capped_timing.capped_step_seconds(settings, [*factors, float(traffic.factors[-1])],
                                           steps=steps, rounds=rounds)

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
  if _WINDOW.value < 0 or not 0 < _MAX_FREQUENCY.value <= 1 or not 0 < _TARGET.value < 1:
    raise misuse(f"--window={_WINDOW.value} must be >= 0, --max_fallback_frequency="
                 f"{_MAX_FREQUENCY.value:g} in (0, 1] and --target_fallback_frequency="
                 f"{_TARGET.value:g} in (0, 1).")


def _timed_note(timed: dict[float, float] | None, traffic: Traffic, priced: bool) -> str:
  """With --time_config, one line on what the timed steps priced (or why nothing)."""
  if timed is None:
    return ""
  measured = sorted({float(f) for f in traffic.timings.factors}) if priced else []
  if not priced:
    return ("\n--time_config: no price changed: the run's timings price only the recorded "
            "expert-parallel size, and --expert_shards regroups it.")
  rest = sorted(f for f in timed if not any(abs(f - m) < 1e-9 for m in measured))
  return (f"\n--time_config: factors {', '.join(f'{f:g}' for f in rest) or 'none'} priced from "
          f"the capped steps timed here; {', '.join(f'{f:g}' for f in measured)} from the run's "
          "own intervals (a measured factor keeps its measurement).")


def main(argv):
  del argv  # launch.cli refuses arguments that are not flags
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
    factors = replay.factor_list(_FACTORS.value, traffic)
    memory = (dict(zip(factors, memory_per_factor(_AOT_CONFIG.value, topology, factors, shards,
                                                  traffic))) if topology else None)
    budget = _BUDGET.value * report.GIB if _BUDGET.value else None
    if timing is not None and not _FACTORS.value:
      # The run's own evidence names a factor, or one to time: --time_config times it too.
      first = replay.advise(traffic, max_frequency=_MAX_FREQUENCY.value, target=_TARGET.value,
                            expert_shards=shards)
      factors = sorted({*factors, *(f for f in (first.factor, first.trial) if f is not None)})
    timed = None if timing is None else capped_times(timing, traffic, factors, shards,
                                                     _TIME_STEPS.value, _TIME_ROUNDS.value)
    # Measured memory or timed steps exist for the table's factors only: the pick is among
    # them, so that every candidate is judged on the same evidence (an untimed factor priced
    # by its FLOPs beside timed ones would win by the FLOPs' overstatement of a buffer's cost).
    advice = replay.advise(
        traffic, max_frequency=_MAX_FREQUENCY.value, target=_TARGET.value, expert_shards=shards,
        factors=factors if _FACTORS.value or memory or timed else None, timed=timed,
        fits=lambda f: budget is None or memory[f] <= budget)
    if advice.factor is not None and advice.factor not in factors:
      factors = sorted([*factors, advice.factor])
    results = replay.plan(traffic, factors, shards)
  for r in results:
    if memory:
      r["memory_bytes_per_device"] = memory[r["factor"]]
    if timed:
      r["capped_step_seconds"] = timed.get(r["factor"], float("nan"))
  priced = shards == traffic.expert_shards
  report.annotate(results, advice, replay.run_factor(traffic) if priced else None)
  run_factors = set(traffic.factors.tolist()) & set(factors)
  path = os.path.join(_WORKDIR.value, "capacity.png")
  title = report.describe(traffic, shards, _WINDOW.value)
  report.plot(results, run_factors, advice, title, path)
  line = report.pick_line(advice, traffic.shape is not None and traffic.shape.adaptive_chunking)
  if _FORMAT.value == "json":
    print(json.dumps(results, indent=2))
    print(line + _timed_note(timed, traffic, priced), file=sys.stderr)
  else:
    print(f"{title}\n\n{report.table(results, run_factors)}\n\n{line}"
          f"{_timed_note(timed, traffic, priced)}\nplot: {path}")


if __name__ == "__main__":
  cli.run(main)
