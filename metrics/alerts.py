"""Host-side overflow alerts: rules over each finished step's `StepMetrics`, sent through the
run's one `metrics.alert_sink.AlertSink` (rate limit, log, `alerts.jsonl`, callback).

Rules:
  fallback_ran           a MoE layer fell back this step
  frequent_fallback      fallback frequency over the trailing window above a threshold
  rows_dropped           the capped buffer dropped rows (the fallback is off)
  near_worst_case        the required factor stayed within a margin of the worst case for
                         `near_worst_steps` steps in a row (the router collapsing, not the
                         untrained router's transient)
  nonfinite_router_input a MoE layer got tokens whose router logits are not finite (NaN or inf
                         input): routed to no expert, their outputs NaN; not an overflow

The trainer raises its own alerts through the same sink (`send`): a skipped non-finite step,
a loss spike, an autopilot factor change (`launch.run.trainer_alerts`).

Each overflow alert's details name the layers, for each layer the receiving expert shards
whose buffer overflowed and the three hottest experts (`hotspots`), since when the condition
holds, how often it happens, and the factor rule's answer on the trailing window
(`metrics.factor_rule`: the factor it names and why, "keep" when it is the factor in force,
or why it names none; the same rule the planner and the autopilot follow);
`nonfinite_router_input` names the layers and their non-finite token counts. `check` runs the
rules on a finished step, so `fallback_ran` names every layer that fell back in it and the
step's required factor (the maximum over layers), as TensorBoard shows them;
`frequent_fallback` waits until the window holds the rule's `min_steps`. Each rule fires at
most once every `min_steps_between` steps; that limit and each condition's start travel with
checkpoints (`state_dict`).
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Callable

from metrics.aggregator import StepMetrics
from metrics.alert_sink import ALERTS_FILE, Alert, AlertSink

__all__ = ["ALERTS_FILE", "Alert", "AlertConfig", "AlertManager", "NONFINITE_RULE"]

NONFINITE_RULE = "nonfinite_router_input"


@dataclasses.dataclass(frozen=True)
class AlertConfig:
  frequency_threshold: float = 0.1   # frequent_fallback fires above this fraction of steps.
  near_worst_fraction: float = 0.9   # near_worst_case: this fraction of the worst case, ...
  near_worst_steps: int = 10         # ... held on this many steps in a row.
  min_steps_between: int = 100       # rate limit per rule, in steps.


class AlertManager:
  """Checks each step's metrics and sends alerts through `sink` (one of its own, to `workdir`,
  `callback` and the log when `log`, unless one is passed in); `send` takes any other alert of
  the run to the same sink.

  `worst_case_factor` is the factor of the worst-case buffer, min(P, E / K): the
  near_worst_case rule compares against it.
  """

  def __init__(self, *, worst_case_factor: float, workdir: str | None = None,
               callback: Callable[[Alert], None] | None = None,
               config: AlertConfig = AlertConfig(), log: bool = True):
    self.worst_case_factor = worst_case_factor
    self.config = config
    self.sink = AlertSink(min_steps_between=config.min_steps_between, workdir=workdir,
                          callback=callback, log=log)
    self._since: dict[str, int] = {}
    self._near_worst: dict[int, int] = {}  # layer -> steps in a row near the worst case
    self._lock = threading.Lock()

  @property
  def path(self) -> str | None:
    """`alerts.jsonl`'s path (None: not written)."""
    return self.sink.path

  def send(self, alert: Alert, *, limited: bool = True) -> bool:
    """Sends an alert raised elsewhere (`AlertSink.send`); whether it went out."""
    return self.sink.send(alert, limited=limited)

  def state_dict(self) -> dict:
    """Each rule's last firing (the rate limit), since when each held condition holds, and the
    layers' runs of steps near the worst case, JSON-serialisable (for checkpoints): a resumed
    run fires no alert the uninterrupted one would not have."""
    with self._lock:
      return {**self.sink.state_dict(), "since": dict(self._since),
              "near_worst": {str(i): n for i, n in self._near_worst.items()}}

  def load_state_dict(self, state: dict) -> None:
    """Restores `state_dict()`'s state."""
    self.sink.load_state_dict(state)
    with self._lock:
      self._since = {rule: int(step) for rule, step in state["since"].items()}
      self._near_worst = {int(i): int(n) for i, n in state["near_worst"].items()}

  def _conditions(self, m: StepMetrics) -> dict[str, list[int]]:
    """Rule -> layers it concerns, for the rules that hold at this step."""
    layers = m.layers.items()
    near = self.config.near_worst_fraction * self.worst_case_factor
    # With one expert shard (or top-k over all experts) the worst case is the balanced load:
    # every step is "near" it, and it says nothing of the router.
    self._near_worst = {i: self._near_worst.get(i, 0) + 1 for i, r in layers
                        if self.worst_case_factor > 1 and r.required_factor >= near}
    held = {
        "fallback_ran": [i for i, r in layers if r.fallback],
        "rows_dropped": [i for i, r in layers if r.dropped_rows > 0],
        "near_worst_case": [i for i, n in self._near_worst.items()
                            if n >= self.config.near_worst_steps],
        NONFINITE_RULE: [i for i, r in layers if r.nonfinite_tokens > 0],
    }
    # Below the rule's minimum window one early step is "100% of recent steps": no alert.
    if m.advice.enough and m.fallback_frequency > self.config.frequency_threshold:
      held["frequent_fallback"] = [i for i, r in layers if r.fallback or r.would_drop_rows]
    return {rule: ls for rule, ls in held.items() if ls or rule == "frequent_fallback"}

  def check(self, m: StepMetrics) -> list[Alert]:
    """Returns (and sends) the alerts of this finished step."""
    with self._lock:
      held = self._conditions(m)
      for rule in list(self._since):
        if rule not in held:
          del self._since[rule]
      alerts = [self._alert(m, rule, layers, self._since.setdefault(rule, m.step))
                for rule, layers in held.items()]
    return [a for a in alerts if self.sink.send(a)]

  def _alert(self, m: StepMetrics, rule: str, layers: list[int], since: int) -> Alert:
    """`rule`'s alert at step `m.step` over `layers`, its condition holding since `since`."""
    fields = dict(layers=layers, since=since, frequency=m.fallback_frequency,
                  required_factor=m.required_factor,
                  recommended_ragged_buffer_factor=m.recommended_factor)
    if rule == NONFINITE_RULE:
      return self._nonfinite_alert(m, fields)
    what = {
        "fallback_ran": "ran the dropless fallback",
        "rows_dropped": f"dropped {m.dropped_rows_fraction:.2%} of routed rows",
        "near_worst_case": (f"needed a buffer factor within "
                            f"{1 - self.config.near_worst_fraction:.0%} of the worst case "
                            f"{self.worst_case_factor:.3g} on {self.config.near_worst_steps} "
                            f"steps in a row (now {m.required_factor:.3g}): the router is "
                            "collapsing onto few experts; raise load_balance_loss_weight"),
        "frequent_fallback": (f"overflowed on {m.fallback_frequency:.0%} of recent steps "
                              f"(threshold {self.config.frequency_threshold:.0%})"),
    }[rule]
    hotspots = [{"layer": i, "receivers": m.layers[i].overflowing_receivers,
                 "hot_experts": m.layers[i].hottest_experts(3)} for i in layers]
    where = "; ".join(f"layer {h['layer']}: " + (
        f"expert shards {h['receivers']} overflowed, " if h["receivers"] else "") +
        f"hottest experts {h['hot_experts']}" for h in hotspots)
    # frequent_fallback also holds at a step where no layer overflowed.
    subject = (f"layers {layers} {what} ({where})" if layers else
               f"the MoE layers {what} (none at this step)")
    message = (f"MoE overflow [{rule}] at step {m.step}: {subject}; "
               f"since step {since}, fallback frequency {m.fallback_frequency:.0%}, required "
               f"factor {m.required_factor:.3g}; {m.advice.reason}")
    return Alert(m.step, rule, message, {**fields, "hotspots": hotspots})

  @staticmethod
  def _nonfinite_alert(m: StepMetrics, fields: dict) -> Alert:
    """`nonfinite_router_input`: bad input, not traffic, so no hotspots (the non-finite tokens
    went to no expert and overflowed nothing)."""
    layers = fields["layers"]
    counts = [m.layers[i].nonfinite_tokens for i in layers]
    per_layer = ", ".join(f"layer {i}: {n}" for i, n in zip(layers, counts))
    message = (f"MoE non-finite router input [{NONFINITE_RULE}] at step {m.step}: layers "
               f"{layers} got tokens whose router logits are NaN or inf ({per_layer}); they "
               f"were routed to no expert (no overflow, no fallback) and their outputs are NaN; "
               f"since step {fields['since']}.")
    return Alert(m.step, NONFINITE_RULE, message,
                 {**fields, "hotspots": [], "nonfinite_tokens": counts})
