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
                           `launch.step_time`'s model of the run's timed intervals, with the
                           fallback chunks replayed at the factor; with its standard error
  relative_step_time       step_seconds over the run's (newest) factor's
  capped_step_seconds      (with --time_config) one capped step of that config at the factor,
                           timed on this machine's devices (`launch.step_timer`): it scales
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
import math
import os
import sys
import textwrap
from typing import Sequence

import jax
import ml_collections
import numpy as np
from absl import app, flags
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from launch import cli, platform
from launch import step_time
from metrics.traffic import Traffic, read_traffic
from moe_hk import dispatch_plan

# launch.aot loads the trainer (CLU and TensorFlow: many seconds), so it loads only when a compile
# is asked for; it defines --compile_topology, so before the flags are parsed.
if any(arg.startswith(("--aot_config", "--compile_topology")) for arg in sys.argv[1:]):
  from launch import aot  # noqa: F401

DEFAULT_FACTORS = (1.0, 1.25, 1.5, 2.0, 3.0)
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

# [M, P, P] traffic matrices -> [M] rows beyond a buffer of R rows (R traced: one compile).
_overflow_rows = jax.jit(jax.vmap(dispatch_plan.overflow_rows, in_axes=(0, None)))


def group_traffic(counts: np.ndarray, expert_shards: int) -> jax.Array:
  """`A [n, layers, G, P, P]` from `counts [n, layers, devices, E]`: G = devices / P groups."""
  n, layers, devices, experts = counts.shape
  for what, size in (("recorded devices", devices), ("experts", experts)):
    if expert_shards < 1 or size % expert_shards:
      raise ValueError(f"expert_shards={expert_shards} must divide the {size} {what}.")
  groups = counts.reshape(-1, expert_shards, experts)  # [n * layers * G, P, E]
  return jax.vmap(dispatch_plan.traffic_matrix)(groups).reshape(
      n, layers, devices // expert_shards, expert_shards, expert_shards)


def plan(traffic: Traffic, factors: Sequence[float],
         expert_shards: int | None = None) -> list[dict]:
  """Per factor, what a capped buffer would have done on every recorded step and MoE layer.

  One dict per factor, in the order given, with the keys of the module docstring (no memory).
  """
  shards = traffic.expert_shards if expert_shards is None else expert_shards
  matrices = group_traffic(traffic.counts, shards)
  flat = matrices.reshape(-1, shards, shards)
  local = traffic.counts.shape[-1] // shards
  routed = traffic.counts.sum(dtype=np.int64)
  results = []
  for factor in factors:
    rows = dispatch_plan.buffer_rows(shards, traffic.tokens_per_device, traffic.k, local, factor)
    beyond = np.asarray(_overflow_rows(flat, rows)).reshape(matrices.shape[:3])  # [n, layers, G]
    overflowing = (beyond > 0).any(axis=2)                                        # [n, layers]
    results.append(dict(
        factor=float(factor),
        fallback_frequency=float(overflowing.any(axis=1).mean()),
        overflowing_layers_mean=float(overflowing.sum(axis=1).mean()),
        would_drop_fraction=float(beyond.sum(dtype=np.int64) / routed),
        buffer_rows=rows,
        expert_shards=shards))
  return results


def price(traffic: Traffic, results: list[dict],
          timed: dict[float, float] | None = None) -> bool:
  """Adds `step_seconds`, `step_seconds_se` and `relative_step_time` to each of `results`
  (`plan`'s, for the recorded expert-parallel size) from the run's timed intervals, scaled to
  the other factors by `timed` (`{factor: seconds of a capped step}`, `launch.step_timer`)
  where it has both factors; False, changing nothing, when the traffic has no timings or run
  shape. With adaptive chunking a fallback is priced at its most chunks
  (`step_time.fallback_chunks`): an upper bound."""
  shape, timings = traffic.shape, traffic.timings
  if shape is None or timings is None or not len(timings.seconds):
    return False
  shards, experts = traffic.expert_shards, traffic.counts.shape[-1]
  # The model prices a factor by its buffer's size: the worst case (-1) as its factor.
  worst = dispatch_plan.worst_case_factor(experts, traffic.k, shards)
  size = lambda factor: np.where(np.asarray(factor) > 0, factor, worst)
  model = step_time.StepTimeModel(timings._replace(factors=size(timings.factors)),
                                  step_time.StepFlops(shape.flops_fixed, shape.flops_per_factor,
                                                      moe_layers=traffic.counts.shape[1]),
                                  {float(size(f)): s for f, s in (timed or {}).items()})

  def seconds(r: dict) -> step_time.Estimate:
    chunks = step_time.fallback_chunks(
        r["factor"], tokens_per_device=traffic.tokens_per_device, seq_len=shape.seq_len,
        k=traffic.k, shards=shards, local_experts=experts // shards,
        requested=shape.requested_chunks)
    return model.step(float(size(r["factor"])), r["overflowing_layers_mean"] * chunks)

  run = float(traffic.factors[-1])
  at_run = next((r for r in results if r["factor"] == run), None) or plan(traffic, [run])[0]
  reference = seconds(at_run).seconds
  for r in results:
    r["step_seconds"], r["step_seconds_se"] = seconds(r)
    r["relative_step_time"] = r["step_seconds"] / reference
  return True


def pick(results: list[dict], budget_bytes: int | None) -> dict | None:
  """The result with the fewest predicted seconds per step among those that fit
  `budget_bytes` (every one when None, or when no memory was compiled)."""
  fits = [r for r in results if math.isfinite(r.get("step_seconds", math.nan)) and (
      budget_bytes is None or r.get("memory_bytes_per_device", 0) <= budget_bytes)]
  return min(fits, key=lambda r: r["step_seconds"], default=None)


def factor_list(values: list[str] | None, traffic: Traffic) -> list[float]:
  """--factors as sorted distinct numbers; default: DEFAULT_FACTORS and the run's own."""
  if values is None:
    # A run on the worst-case buffer (-1) never overflows: nothing to replay for it.
    return sorted({*DEFAULT_FACTORS, *(f for f in traffic.factors.tolist() if f > 0)})
  text = ",".join(values)
  try:
    factors = [float(v) for v in values]
  except ValueError:
    raise ValueError(f"--factors={text}: not a comma-separated list of numbers.") from None
  if not factors or not all(math.isfinite(f) and f > 0 for f in factors):
    raise ValueError(f"--factors={text}: need one or more positive buffer factors, e.g. 1,1.5,2.")
  return sorted(set(factors))


def memory_per_factor(config: ml_collections.ConfigDict, topology: str,
                      factors: Sequence[float], expert_shards: int,
                      traffic: Traffic) -> list[int]:
  """Per-device bytes of `config`'s train step with a `layer` fallback, one figure per factor.

  The mesh gets `expert_shards` on its expert axis; fsdp takes up the rest of the devices.
  """
  from launch import aot, trainer  # loaded only when asked for, see the top of this file
  devices = aot.topology_devices(topology)
  check_routing(config, traffic, "aot_config")
  c = config.copy_and_resolve_references()
  fsdp, rest = divmod(len(devices), c.mesh.data * expert_shards)
  if rest:
    raise ValueError(f"config.mesh.data={c.mesh.data} x expert={expert_shards} does not divide "
                     f"the {len(devices)} devices of --compile_topology={topology}.")
  c.mesh.expert, c.mesh.fsdp = expert_shards, fsdp
  trainer.validate(c, devices=len(devices))
  memory = []
  for factor in factors:
    c.moe.ragged_buffer_factor = factor
    memory.append(aot.compile_variant(c, devices, "fallback_scan")["total_bytes"])
  return memory


def check_routing(config: ml_collections.ConfigDict, traffic: Traffic, flag: str) -> None:
  """ValueError unless `config` (--`flag`) routes like the recorded run: experts and top-K."""
  experts = traffic.counts.shape[-1]
  if (config.moe.num_experts, config.moe.num_experts_per_tok) != (experts, traffic.k):
    raise ValueError(f"--{flag} has {config.moe.num_experts} experts, top-"
                     f"{config.moe.num_experts_per_tok}; the traffic {experts}, top-{traffic.k}.")


def capped_times(config: ml_collections.ConfigDict, traffic: Traffic, factors: Sequence[float],
                 expert_shards: int, steps: int, rounds: int) -> dict[float, float]:
  """`launch.step_timer`'s seconds of a capped step of `config` (the run's, checked against
  the traffic) at each of `factors` and the run's newest factor, on this machine's devices."""
  from launch import step_timer, trainer  # loaded only when asked for: compiles and runs
  check_routing(config, traffic, "time_config")
  c = config.copy_and_resolve_references()
  trainer.validate(c)
  tokens = c.data.batch_size * c.data.seq_len // jax.device_count()
  recorded = (traffic.expert_shards, traffic.tokens_per_device, traffic.expert_shards)
  if (c.mesh.expert, tokens, expert_shards) != recorded:
    raise ValueError(
        f"--time_config runs P={c.mesh.expert} expert shards with T={tokens} tokens per "
        f"device and prices P={expert_shards}; the run recorded P={traffic.expert_shards}, "
        f"T={traffic.tokens_per_device}: pass the run's config and its expert-parallel size.")
  return step_timer.capped_step_seconds(c, [*factors, float(traffic.factors[-1])],
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


def _topology() -> str | None:
  """--compile_topology, when given (launch.aot defines it, and loads only when asked)."""
  given = "compile_topology" in flags.FLAGS and flags.FLAGS["compile_topology"].present
  return flags.FLAGS.compile_topology if given else None


def _cpu_devices(topology: str | None) -> int:
  """The CPU devices to start jax with: launch.aot's for the topology, else one (the replay's)."""
  if topology is None:
    return 1
  from launch import aot  # loaded when --compile_topology is given, see the top of this file
  return aot.cpu_device_count(topology)


def main(argv):
  del argv  # launch.cli refuses arguments that are not flags
  topology = _topology()
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
  try:
    # The replay needs no accelerator (a run may hold it) and a compile is launch.aot's, for a
    # topology, from the CPU: both take the CPU. Timing takes the run's own devices.
    if timing is None:
      platform.setup(_cpu_devices(topology), cpu_only=True)
    else:
      platform.setup(timing.cpu_devices)
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
  except ValueError as e:
    raise app.UsageError(str(e)) from None
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
