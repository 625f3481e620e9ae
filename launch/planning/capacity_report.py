"""What `launch.capacity` shows: the replayed factors as a table or JSON rows, the factor rule's
answer in one line, and `capacity.png`.

A row is one factor of `launch.planning.replay.plan`; `annotate` adds what the rule's rows say
of it (the seconds per step measured at it with their error and basis, relative to the factor
in force, and whether it is the pick: the pick is always a row). A price whose error is not
known (one timed interval) shows as such, never as an infinite number.
"""
from __future__ import annotations

import math
import textwrap

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from metrics import factor_rule
from metrics.traffic import Traffic

GIB, MIB = 1024 ** 3, 1024 ** 2


def describe(traffic: Traffic, expert_shards: int, window: int) -> str:
  """One line: what was recorded, how it is grouped and how many traffic files were skipped."""
  n, layers, devices, experts = traffic.counts.shape
  skipped = len(traffic.skipped)
  return (f"{n} steps ({traffic.steps[0]}..{traffic.steps[-1]}"
          f"{f', the last {window} of the run' if window else ''}), {layers} MoE layers, "
          f"{devices} devices, E={experts}, T={traffic.tokens_per_device}, K={traffic.k}; "
          f"expert groups of P={expert_shards} (recorded with P={traffic.expert_shards}); "
          f"{skipped} file{'' if skipped == 1 else 's'} skipped")


def annotate(results: list[dict], advice: factor_rule.Advice) -> None:
  """Adds to each row of `results` what the rule's rows say of its factor: the price
  (`step_seconds`, `step_seconds_se`: None when not known), its `basis` ('measured', 'timed',
  None: never timed), `relative_step_time` (to the factor in force, when both are priced)
  and `pick`."""
  rows = {r.factor: r for r in advice.rows}
  at = lambda f: next((r for g, r in rows.items() if math.isclose(g, f)), None)
  now = at(advice.current) if advice.current is not None else None
  base = now.price if now is not None else None
  for r in results:
    row = at(r["factor"])
    price = None if row is None else row.price
    r["step_seconds"] = None if price is None else price.seconds
    r["step_seconds_se"] = price.se if price is not None and math.isfinite(price.se) else None
    r["basis"] = None if price is None else price.basis
    r["relative_step_time"] = (price.seconds / base.seconds if price is not None and
                               base is not None and base.basis == price.basis else None)
    r["pick"] = advice.factor is not None and math.isclose(r["factor"], advice.factor)


def memory_unit(results: list[dict]) -> tuple[str, int]:
  """The unit of the memory figures: GiB, or MiB when all are below a GiB (small configs)."""
  largest = max(r["memory_bytes_per_device"] for r in results)
  return ("GiB", GIB) if largest >= GIB else ("MiB", MIB)


def _price(r: dict) -> str:
  if r["step_seconds"] is None:
    return "- (never timed)"
  error = "error unknown" if r["step_seconds_se"] is None else f"± {r['step_seconds_se']:.4f}"
  return f"{r['step_seconds']:.4f} {error} ({r['basis']})"


def table(results: list[dict], run_factors: set[float]) -> str:
  """`results` as a markdown table, the run's own factors and the pick marked."""
  memory = "memory_bytes_per_device" in results[0]
  timed = any(r["step_seconds"] is not None for r in results)
  unit, size = memory_unit(results) if memory else (None, None)
  head = (["factor", "buffer rows", "fallback frequency", "overflowing layers (mean)",
           "would drop"] + ([f"memory / device ({unit})"] if memory else []) +
          (["s / step (basis)", "relative step time"] if timed else []))
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in results:
    marks = [m for m, on in (("run", r["factor"] in run_factors), ("pick", r["pick"])) if on]
    cells = [f"{r['factor']:g}" + (f" ({', '.join(marks)})" if marks else ""),
             str(r["buffer_rows"]), f"{r['fallback_frequency']:.1%}",
             f"{r['overflowing_layers_mean']:.2f}", f"{r['would_drop_fraction']:.3%}"]
    if memory:
      cells.append(f"{r['memory_bytes_per_device'] / size:.2f}")
    if timed:
      relative = r["relative_step_time"]
      cells += [_price(r), "-" if relative is None else f"{relative:.3f}"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def pick_line(advice: factor_rule.Advice) -> str:
  """One line: the factor the rule names and why, or why it names none."""
  head = f"pick: {advice.factor:g}" if advice.factor is not None else "pick: none"
  return f"{head} ({advice.basis or 'no factor'}): {advice.reason}"


def plot(results: list[dict], run_factors: set[float], advice: factor_rule.Advice,
         title: str, path: str) -> None:
  """Fallback frequency and would-drop fraction against the factor, memory on a second axis;
  below, when priced, the relative step time with a band of two standard errors; the pick (or
  that there is none) marked on both."""
  timed = any(r["relative_step_time"] is not None for r in results)
  figure = Figure(figsize=(8, 7.2 if timed else 4.8), layout="constrained")
  FigureCanvasAgg(figure)
  axes, *below = figure.subplots(2 if timed else 1, 1, sharex=True, squeeze=False)[:, 0]
  factors = [r["factor"] for r in results]
  axes.plot(factors, [r["fallback_frequency"] for r in results], "o-", label="fallback frequency")
  axes.plot(factors, [r["would_drop_fraction"] for r in results], "s--",
            label="would-drop fraction (no fallback)")
  for i, factor in enumerate(sorted(run_factors)):
    axes.axvline(factor, color="gray", linestyle=":", label=None if i else "the run's factor")
  for ax in (axes, *below):
    if advice.factor is not None:
      ax.axvline(advice.factor, color="C3", linewidth=2, alpha=0.6,
                 label=f"pick: {advice.factor:g}" if ax is axes else None)
  axes.set(xlabel="ragged_buffer_factor", ylabel="fraction")
  heading = title + ("" if advice.factor is not None else " | pick: none (see the table)")
  axes.set_title(textwrap.fill(heading, 80), fontsize="medium")
  axes.set_ylim(bottom=0)
  if "memory_bytes_per_device" in results[0]:
    unit, size = memory_unit(results)
    memory = axes.twinx()
    memory.plot(factors, [r["memory_bytes_per_device"] / size for r in results], "^-",
                color="C2", label=f"memory / device ({unit})")
    memory.set_ylabel(f"{unit} per device")
    memory.set_ylim(bottom=0)
  if timed:
    _step_time_axes(below[0], results)
  # Below the axes: inside, it would hide points of one of the curves.
  figure.legend(loc="outside lower center", ncols=2)
  figure.savefig(path, dpi=120)


def _step_time_axes(ax, results: list[dict]) -> None:
  """The relative step time and its two-standard-error band (where the error is known)."""
  rows = [r for r in results if r["relative_step_time"] is not None]
  x = [r["factor"] for r in rows]
  y = [r["relative_step_time"] for r in rows]
  ax.plot(x, y, "d", color="C3", label="relative step time (measured, 1 = the run's)")
  band = [(r["factor"], r["relative_step_time"],
           2 * r["step_seconds_se"] * r["relative_step_time"] / r["step_seconds"])
          for r in rows if r["step_seconds_se"] is not None]
  if band:
    bx, by, err = zip(*band)
    ax.fill_between(bx, [a - e for a, e in zip(by, err)], [a + e for a, e in zip(by, err)],
                    color="C3", alpha=0.2, label="± 2 standard errors")
  ax.set(xlabel="ragged_buffer_factor", ylabel="step time / the run's")
