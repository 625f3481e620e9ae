"""Replays a run's recorded MoE traffic through the dispatch plan, for candidate buffer factors.

  python -m launch.capacity --workdir=DIR [--factors=1,1.25,1.5,2,3] [--expert_shards=P]
      [--format=table|json] [--aot_config=PATH --compile_topology=TOPO [--aot_config.KEY=V ...]
      [--memory_budget_gib=G]] [--time_config=PATH [--time_config.KEY=V ...]]

For each `ragged_buffer_factor` (default: 1,1.25,1.5,2,3 and the run's own) the capped buffer of
R rows per receiving shard is replayed on every recorded step and MoE layer (WORKDIR/traffic/,
`metrics.traffic`):

  fallback_frequency       fraction of steps with >= 1 overflowing layer: the fallback would run
  overflowing_layers_mean  overflowing MoE layers per step, averaged over the steps
  would_drop_fraction      rows beyond the buffers / routed rows: dropped without a fallback
  buffer_rows              R per receiving shard
  expert_shards            P, the expert-parallel size the traffic is grouped for
  memory_bytes_per_device  (with --aot_config) the config's train step, capped + `layer`
                           fallback, compiled by `launch.aot` for --compile_topology
  step_seconds             (when the run timed its steps) predicted seconds per step:
                           `launch.planning.step_model`'s model of the run's timed intervals, with the
                           fallback chunks replayed at the factor; with its standard error
  relative_step_time       step_seconds over the run's (newest) factor's
  capped_step_seconds      (with --time_config) one capped step of that config at the factor,
                           timed on this machine's devices (`launch.planning.capped_timing`): it scales
                           the run's measured step to the factors the run did not train at,
                           in place of the matmul FLOPs (which overstate a bigger buffer's cost
                           where the grouped matmul skips its empty rows)
  pick                     (JSON, when timed) whether this is the factor the planner picks

--time_config is the run's own config (its shapes must be the run's); it compiles and runs
one program per factor here, so it wants the machine the run trained on, idle, and cannot go
with --compile_topology (run the two separately).

The pick is the factor with the fewest predicted seconds per step among those whose memory
fits --memory_budget_gib (when memory is compiled); without timings, none is named.

`--expert_shards` regroups the same devices (same tokens per device) into expert groups of that
size. Prints a markdown table, or a JSON list with --format=json; writes WORKDIR/capacity.png.
Traffic files it cannot use are skipped, a warning each; the table's first line counts them.
"""
import json
import os
import textwrap
from typing import Sequence

import jax
import ml_collections
from absl import app, flags
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from launch import cli, platform, settings as settings_lib
from launch.compiling import topology as topology_lib
from launch.errors import user_errors
from launch.planning.replay import (DEFAULT_FACTORS, check_routing, factor_list, plan, pick,
                                    price)
from metrics.traffic import Traffic, read_traffic

GIB, MIB = 1024 ** 3, 1024 ** 2

_WORKDIR = flags.DEFINE_string("workdir", None, "Workdir of a launch.train run (its traffic/).",
                               required=True)
_FACTORS = flags.DEFINE_list("factors", None, "Buffer factors to replay; default "
                             f"{','.join(f'{f:g}' for f in DEFAULT_FACTORS)} and the run's own.")
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
  check_routing(settings.layer, traffic, "aot_config")
  return [variants.compile_variant(programs.at_factor(settings, f), devices,
                                   "fallback_scan")["total_bytes"] for f in factors]


def capped_times(config: ml_collections.ConfigDict, traffic: Traffic, factors: Sequence[float],
                 expert_shards: int, steps: int, rounds: int) -> dict[float, float]:
  """Seconds of a capped step of `config` (the run's, checked against the traffic) at each of
  `factors` and the run's newest factor, on this machine's devices
  (`launch.planning.capped_timing`)."""
  from launch.planning import capped_timing  # compiles and runs: only when asked for
  settings = settings_lib.build(config, jax.device_count())
  check_routing(settings.layer, traffic, "time_config")
  tokens = config.data.batch_size * config.data.seq_len // jax.device_count()
  recorded = (traffic.expert_shards, traffic.tokens_per_device, traffic.expert_shards)
  if (settings.expert_shards, tokens, expert_shards) != recorded:
    raise ValueError(
        f"--time_config runs P={settings.expert_shards} expert shards with T={tokens} tokens "
        f"per device and prices P={expert_shards}; the run recorded P={traffic.expert_shards}, "
        f"T={traffic.tokens_per_device}: pass the run's config and its expert-parallel size.")
  return capped_timing.capped_step_seconds(settings, [*factors, float(traffic.factors[-1])],
                                           steps=steps, rounds=rounds)

def describe(traffic: Traffic, expert_shards: int) -> str:
  """One line: what was recorded, how it is grouped and how many traffic files were skipped."""
  n, layers, devices, experts = traffic.counts.shape
  skipped = len(traffic.skipped)
  return (f"{n} steps ({traffic.steps[0]}..{traffic.steps[-1]}), {layers} MoE layers, "
          f"{devices} devices, E={experts}, T={traffic.tokens_per_device}, K={traffic.k}; "
          f"expert groups of P={expert_shards} (recorded with P={traffic.expert_shards}); "
          f"{skipped} file{'' if skipped == 1 else 's'} skipped")


def memory_unit(results: list[dict]) -> tuple[str, int]:
  """The unit of the memory figures: GiB, or MiB when all are below a GiB (small configs)."""
  largest = max(r["memory_bytes_per_device"] for r in results)
  return ("GiB", GIB) if largest >= GIB else ("MiB", MIB)


def table(results: list[dict], run_factors: set[float]) -> str:
  """`results` as a markdown table, the run's own factors marked."""
  memory = "memory_bytes_per_device" in results[0]
  timed = "step_seconds" in results[0]
  capped = "capped_step_seconds" in results[0]
  unit, size = memory_unit(results) if memory else (None, None)
  head = (["factor", "buffer rows", "fallback frequency", "overflowing layers (mean)",
           "would drop"] + ([f"memory / device ({unit})"] if memory else []) +
          (["capped s / step (timed here)"] if capped else []) +
          (["s / step (predicted)", "relative step time"] if timed else []))
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in results:
    cells = [f"{r['factor']:g}" + (" (run)" if r["factor"] in run_factors else ""),
             str(r["buffer_rows"]), f"{r['fallback_frequency']:.1%}",
             f"{r['overflowing_layers_mean']:.2f}", f"{r['would_drop_fraction']:.3%}"]
    if memory:
      cells.append(f"{r['memory_bytes_per_device'] / size:.2f}")
    if capped:
      cells.append(f"{r['capped_step_seconds']:.4f}")
    if timed:
      cells += [f"{r['step_seconds']:.4f} ± {r['step_seconds_se']:.4f}",
                f"{r['relative_step_time']:.3f}"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot(results: list[dict], run_factors: set[float], title: str, path: str) -> None:
  """Fallback frequency and would-drop fraction against the factor; memory on a second axis."""
  timed = "relative_step_time" in results[0]
  figure = Figure(figsize=(8, 7.2 if timed else 4.8), layout="constrained")
  FigureCanvasAgg(figure)
  axes, *below = figure.subplots(2 if timed else 1, 1, sharex=True, squeeze=False)[:, 0]
  factors = [r["factor"] for r in results]
  axes.plot(factors, [r["fallback_frequency"] for r in results], "o-", label="fallback frequency")
  axes.plot(factors, [r["would_drop_fraction"] for r in results], "s--",
            label="would-drop fraction (no fallback)")
  for i, factor in enumerate(sorted(run_factors)):
    axes.axvline(factor, color="gray", linestyle=":", label=None if i else "the run's factor")
  axes.set(xlabel="ragged_buffer_factor", ylabel="fraction")
  axes.set_title(textwrap.fill(title, 80), fontsize="medium")
  axes.set_ylim(bottom=0)
  if "memory_bytes_per_device" in results[0]:
    unit, size = memory_unit(results)
    memory = axes.twinx()
    memory.plot(factors, [r["memory_bytes_per_device"] / size for r in results], "^-",
                color="C2", label=f"memory / device ({unit})")
    memory.set_ylabel(f"{unit} per device")
    memory.set_ylim(bottom=0)
  if timed:
    below[0].errorbar(factors, [r["relative_step_time"] for r in results],
                      yerr=[r["step_seconds_se"] * r["relative_step_time"] / r["step_seconds"]
                            for r in results], fmt="d-",
                      color="C3", label="relative step time (predicted, 1 = the run's)")
    below[0].set(xlabel="ragged_buffer_factor", ylabel="step time / the run's")
  # Below the axes: inside, it would hide points of one of the curves.
  figure.legend(loc="outside lower center", ncols=2)
  figure.savefig(path, dpi=120)


def pick_line(chosen: dict | None, priced: bool, budget: int | None, adaptive: bool) -> str:
  """One line naming the pick, or why there is none; `adaptive`: the run chunked its
  fallbacks adaptively, so their prices are upper bounds."""
  if not priced:
    return "pick: none (the run recorded no step timings for this expert-parallel size)"
  if chosen is None:
    return f"pick: none fits the memory budget of {budget / GIB:g} GiB"
  return (f"pick: factor {chosen['factor']:g}, {chosen['step_seconds']:.4f} s/step predicted "
          f"({chosen['relative_step_time']:.3f} x the run's)" +
          ("; adaptive chunking: fallbacks priced at their most chunks" if adaptive else ""))


def main(argv):
  del argv  # launch.cli refuses arguments that are not flags
  topology = _TOPOLOGY.value if flags.FLAGS["compile_topology"].present else None
  if _BUDGET.value < 0:
    raise app.UsageError(f"--memory_budget_gib={_BUDGET.value:g} must be >= 0 (0: no budget).",
                         exitcode=cli.FLAG_MISUSE)
  if _BUDGET.value and topology is None:
    raise app.UsageError(f"--memory_budget_gib={_BUDGET.value:g} needs the compiled memory it "
                         "is compared with: add --aot_config=CFG --compile_topology=TOPO.",
                         exitcode=cli.FLAG_MISUSE)
  if (_AOT_CONFIG.value is None) != (topology is None):
    raise app.UsageError("--aot_config and --compile_topology go together (e.g. "
                         "--aot_config=launch/configs/tiny.py --compile_topology=cpu:8).",
                         exitcode=cli.FLAG_MISUSE)
  timing = _TIME_CONFIG.value
  if timing is not None and topology:
    raise app.UsageError("--time_config times on this machine's devices and "
                         "--compile_topology compiles for another: run them separately.",
                         exitcode=cli.FLAG_MISUSE)
  if min(_TIME_STEPS.value, _TIME_ROUNDS.value) < 1:
    raise app.UsageError(f"--time_steps={_TIME_STEPS.value} and --time_rounds="
                         f"{_TIME_ROUNDS.value} must be >= 1.", exitcode=cli.FLAG_MISUSE)
  with user_errors():
    # The replay needs no accelerator (a run may hold it) and a compile is launch.aot's, for a
    # topology, from the CPU: both take the CPU. Timing takes the run's own devices.
    if timing is None:
      platform.setup(1 if topology is None else topology_lib.cpu_device_count(topology),
                     cpu_only=True)
    else:
      platform.setup(settings_lib.cpu_devices(timing))
    traffic = read_traffic(_WORKDIR.value)
    factors = factor_list(_FACTORS.value, traffic)
    results = plan(traffic, factors, _EXPERT_SHARDS.value)
    shards = results[0]["expert_shards"]
    if topology:
      memory = memory_per_factor(_AOT_CONFIG.value, topology, factors, shards, traffic)
      for r, m in zip(results, memory):
        r["memory_bytes_per_device"] = m
    timed = None if timing is None else capped_times(timing, traffic, factors, shards,
                                                     _TIME_STEPS.value, _TIME_ROUNDS.value)
  for r in results if timed else ():
    r["capped_step_seconds"] = timed[r["factor"]]
  # The timings are the recorded run's: they price its own expert-parallel size only.
  priced = shards == traffic.expert_shards and price(traffic, results, timed)
  budget = int(_BUDGET.value * GIB) if _BUDGET.value else None
  chosen = pick(results, budget) if priced else None
  run_factors = set(traffic.factors.tolist()) & set(factors)
  path = os.path.join(_WORKDIR.value, "capacity.png")
  plot(results, run_factors, describe(traffic, shards), path)
  if _FORMAT.value == "json":
    for r in results if priced else ():
      r["pick"] = r is chosen
    print(json.dumps(results, indent=2))
  else:
    print(f"{describe(traffic, shards)}\n\n{table(results, run_factors)}\n\n"
          f"{pick_line(chosen, priced, budget, priced and traffic.shape.adaptive_chunking)}"
          f"\nplot: {path}")


if __name__ == "__main__":
  cli.run(main)
