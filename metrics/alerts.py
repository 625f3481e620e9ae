"""Host-side overflow alerts: rules over `StepMetrics`, rate-limited, to three sinks.

Rules:
  fallback_ran           a MoE layer fell back this step
  frequent_fallback      fallback frequency over the trailing window above a threshold
  rows_dropped           the capped buffer dropped rows (the fallback is off)
  near_worst_case        the required factor stayed within a margin of the worst case for
                         `near_worst_steps` steps in a row (the router collapsing, not the
                         untrained router's transient)
  nonfinite_router_input a MoE layer got tokens whose router logits are not finite (NaN or inf
                         input): routed to no expert, their outputs NaN; not an overflow
  buffer_factor_changed  the launcher's autopilot switched the buffer factor (`factor_changed`)
  nonfinite_step         the trainer skipped a step whose loss or gradient norm was not finite
                         (`nonfinite_step`)
  loss_spike             the trainer skipped a step whose loss or gradient norm spiked above its
                         recent window (`loss_spike`)

The two skip alerts carry the step's `data_position` (where its batch came from) and, from the
trainer, the `launch.batch` command that prints it.

Each overflow alert names the step, the layers, for each layer the receiving expert shards
whose buffer overflowed and the three hottest experts, since when the condition holds, how
often it happens, and the factor rule's answer on the trailing window
(`metrics.factor_rule`: the factor it names and why, "keep" when it is the factor in force,
or why it names none; the same rule the planner and the autopilot follow);
`nonfinite_router_input` names the step, the layers and their non-finite token counts
(`details`). `check` runs the rules on a finished step, so `fallback_ran` names every layer
that fell back in it and the step's required factor (the maximum over layers), as
TensorBoard shows them; `frequent_fallback` waits until the window holds the rule's
`min_steps`. Sinks: absl `logging.warning`, `alerts.jsonl` in the
workdir (one JSON object a line), and an optional callable. A rule fires at most once every
`min_steps_between` steps; that limit and each condition's start travel with checkpoints
(`state_dict`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from typing import Callable, NamedTuple

from absl import logging

from metrics.aggregator import StepMetrics

ALERTS_FILE = "alerts.jsonl"  # in the workdir: one JSON object per alert
NONFINITE_RULE = "nonfinite_router_input"
NONFINITE_STEP_RULE = "nonfinite_step"
SPIKE_RULE = "loss_spike"


@dataclasses.dataclass(frozen=True)
class AlertConfig:
  frequency_threshold: float = 0.1   # frequent_fallback fires above this fraction of steps.
  near_worst_fraction: float = 0.9   # near_worst_case: this fraction of the worst case, ...
  near_worst_steps: int = 10         # ... held on this many steps in a row.
  min_steps_between: int = 100       # rate limit per rule, in steps.


class Alert(NamedTuple):
  time: float
  step: int
  rule: str
  layers: list
  hotspots: list     # per layer: {"layer", "receivers" (overflowing expert shards), "hot_experts"}
  since: int
  frequency: float
  required_factor: float
  # The factor rule's factor (None: the evidence names none; for buffer_factor_changed the
  # new factor).
  recommended_ragged_buffer_factor: float | None
  message: str
  # buffer_factor_changed: old and new factor, the evidence; nonfinite_router_input:
  # {"nonfinite_tokens": [count per layer in `layers`]}; nonfinite_step: loss, grad_norm.
  details: dict | None = None


class AlertManager:
  """Checks each step's metrics and sends alerts.

  `worst_case_factor` is the factor of the worst-case buffer, min(P, E / K): the
  near_worst_case rule compares against it.
  """

  def __init__(self, *, worst_case_factor: float, workdir: str | None = None,
               callback: Callable[[Alert], None] | None = None,
               config: AlertConfig = AlertConfig(), log: bool = True):
    self.worst_case_factor = worst_case_factor
    self.log = log  # send to absl logging (a trainer's processes other than 0 do not)
    self.config = config
    self.callback = callback
    self.path = os.path.join(workdir, ALERTS_FILE) if workdir else None
    self._since: dict[str, int] = {}
    self._last_sent: dict[str, int] = {}
    self._near_worst: dict[int, int] = {}  # layer -> steps in a row near the worst case
    self._lock = threading.Lock()

  def state_dict(self) -> dict:
    """Each rule's last firing (the rate limit), since when each held condition holds, and the
    layers' runs of steps near the worst case, JSON-serialisable (for checkpoints): a resumed
    run fires no alert the uninterrupted one would not have."""
    with self._lock:
      return {"last_sent": dict(self._last_sent), "since": dict(self._since),
              "near_worst": {str(i): n for i, n in self._near_worst.items()}}

  def load_state_dict(self, state: dict) -> None:
    """Restores `state_dict()`'s state."""
    with self._lock:
      self._last_sent = {rule: int(step) for rule, step in state["last_sent"].items()}
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
      return [a for rule, layers in held.items() if (a := self._fire(m, rule, layers))]

  def factor_changed(self, step: int, old: float, new: float, reason: str,
                     evidence: dict) -> Alert:
    """`buffer_factor_changed`: the autopilot switched the buffer factor (never rate-limited:
    the autopilot's own hysteresis bounds how often)."""
    frequency = float(evidence.get("observed_recent_frequency", 0.0))
    required = float(evidence.get("max_required_factor", 0.0))
    memory = evidence.get("memory_bytes_per_device")
    message = (f"MoE autopilot [buffer_factor_changed] at step {step}: ragged_buffer_factor "
               f"{old:g} -> {new:g} ({reason}): {evidence.get('advice', '')}" +
               (f" The new program needs {memory / 2**20:.1f} MiB per device." if memory else ""))
    alert = Alert(time=time.time(), step=step, rule="buffer_factor_changed", layers=[],
                  hotspots=[], since=step, frequency=frequency, required_factor=required,
                  recommended_ragged_buffer_factor=new, message=message,
                  details={"old_factor": old, "new_factor": new, "reason": reason,
                           "evidence": evidence})
    with self._lock:
      self._send(alert)
    return alert

  def nonfinite_step(self, step: int, loss: float, grad_norm: float,
                     data_position: dict | None = None, batch_command: str = "") -> Alert | None:
    """`nonfinite_step`: the train step's loss or gradient norm was not finite, so the
    trainer skipped its update (rate-limited like the rules); `batch_command` prints the
    step's batch (`launch.batch`)."""
    message = (f"Non-finite train step [{NONFINITE_STEP_RULE}] at step {step}: loss {loss:g}, "
               f"gradient norm {grad_norm:g}; the update was skipped (params and optimizer "
               "state unchanged). Look for nonfinite_router_input alerts, the data of this "
               f"step{f' ({batch_command})' if batch_command else ''} and the learning rate.")
    return self._skipped(NONFINITE_STEP_RULE, step, message,
                         {"loss": loss, "grad_norm": grad_norm, "data_position": data_position})

  def loss_spike(self, step: int, loss: float, grad_norm: float, mean: tuple[float, float],
                 std: tuple[float, float], sigma: float, window: int,
                 data_position: dict | None = None, batch_command: str = "") -> Alert | None:
    """`loss_spike`: the step's loss or gradient norm was more than `sigma` deviations above
    the mean of its window (`mean`, `std`: (loss, gradient norm)); its update was skipped."""
    spiked = [f"{name} {value:.4g} (window mean {m:.4g}, deviation {d:.3g}, "
              f"{(value - m) / d if d else float('inf'):.1f} sigma)"
              for name, value, m, d in (("loss", loss, mean[0], std[0]),
                                        ("gradient norm", grad_norm, mean[1], std[1]))
              if value > m + sigma * d]
    message = (f"Train step spike [{SPIKE_RULE}] at step {step}: {'; '.join(spiked)} above "
               f"{sigma:g} sigma of the last {window} applied steps; the update was skipped "
               "(params and optimizer state unchanged)." +
               (f" Its batch: {batch_command}." if batch_command else ""))
    return self._skipped(SPIKE_RULE, step, message, {
        "loss": loss, "grad_norm": grad_norm, "window_mean": list(mean),
        "window_std": list(std), "sigma": sigma, "data_position": data_position})

  def _skipped(self, rule: str, step: int, message: str, details: dict) -> Alert | None:
    """A skipped step's alert (rate-limited like the rules)."""
    with self._lock:
      if not self._due(rule, step):
        return None
      alert = Alert(time=time.time(), step=step, rule=rule, layers=[], hotspots=[],
                    since=step, frequency=0.0, required_factor=0.0,
                    recommended_ragged_buffer_factor=None, message=message, details=details)
      self._send(alert)
    return alert

  def _due(self, rule: str, step: int) -> bool:
    """Whether `rule` may fire at `step` (its last alert is `min_steps_between` steps back);
    if so, records it as sent (lock held)."""
    last = self._last_sent.get(rule)
    if last is not None and step - last < self.config.min_steps_between:
      return False
    self._last_sent[rule] = step
    return True

  def _fire(self, m: StepMetrics, rule: str, layers: list[int]) -> Alert | None:
    """Sends `rule`'s alert unless it fired within `min_steps_between` steps (lock held)."""
    since = self._since.setdefault(rule, m.step)
    if not self._due(rule, m.step):
      return None
    alert = self._alert(m, rule, layers, since)
    self._send(alert)
    return alert

  def _alert(self, m: StepMetrics, rule: str, layers: list[int], since: int) -> Alert:
    recommended = m.recommended_factor
    if rule == NONFINITE_RULE:
      return self._nonfinite_alert(m, layers, since, recommended)
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
    return Alert(time=time.time(), step=m.step, rule=rule, layers=layers, hotspots=hotspots,
                 since=since,
                 frequency=m.fallback_frequency, required_factor=m.required_factor,
                 recommended_ragged_buffer_factor=recommended, message=message)

  def _nonfinite_alert(self, m: StepMetrics, layers: list[int], since: int,
                       recommended: float | None) -> Alert:
    """`nonfinite_router_input`: bad input, not traffic, so no hotspots (the non-finite tokens
    went to no expert and overflowed nothing)."""
    counts = [m.layers[i].nonfinite_tokens for i in layers]
    per_layer = ", ".join(f"layer {i}: {n}" for i, n in zip(layers, counts))
    message = (f"MoE non-finite router input [{NONFINITE_RULE}] at step {m.step}: layers "
               f"{layers} got tokens whose router logits are NaN or inf ({per_layer}); they "
               f"were routed to no expert (no overflow, no fallback) and their outputs are NaN; "
               f"since step {since}.")
    return Alert(time=time.time(), step=m.step, rule=NONFINITE_RULE, layers=layers,
                 hotspots=[], since=since, frequency=m.fallback_frequency,
                 required_factor=m.required_factor, recommended_ragged_buffer_factor=recommended,
                 message=message, details={"nonfinite_tokens": counts})

  def _send(self, alert: Alert) -> None:
    if self.log:
      logging.warning(alert.message)
    if self.path:
      with open(self.path, "a") as f:
        f.write(json.dumps(alert._asdict()) + "\n")
    if self.callback is not None:
      self.callback(alert)
