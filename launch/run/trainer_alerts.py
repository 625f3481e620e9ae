"""The alerts the trainer raises itself, sent through the run's one sink
(`metrics.alert_sink`) beside the MoE overflow rules':

  nonfinite_step         a step's loss or gradient norm was not finite; its update was skipped
  loss_spike             a step's loss or gradient norm spiked above its recent window; its
                         update was skipped
  buffer_factor_changed  the autopilot switched the buffer factor (never rate-limited: the
                         autopilot's hysteresis bounds how often)

The two skip alerts carry where the step's batch came from (`data_position`) and the
`launch.batch` command that prints it.
"""
from __future__ import annotations

from typing import NamedTuple

from launch.planning.autopilot import Decision
from launch.run.records import StepRecord
from launch.setup import cli
from metrics.alert_sink import Alert

NONFINITE_STEP_RULE = "nonfinite_step"
SPIKE_RULE = "loss_spike"
FACTOR_CHANGED_RULE = "buffer_factor_changed"


class BatchSource(NamedTuple):
  """Where a step's batch came from: its position in the data, and the command printing it."""
  data_position: dict
  batch_command: str


def batch_command(workdir: str, step: int) -> str:
  """The command that prints step `step`'s batch (`launch.batch`)."""
  return cli.runnable("python", "-m", "launch.batch", f"--workdir={workdir}", f"--step={step}")


def nonfinite_step(record: StepRecord, source: BatchSource) -> Alert:
  """`nonfinite_step`: the step's loss or gradient norm was not finite."""
  message = (f"Non-finite train step [{NONFINITE_STEP_RULE}] at step {record.step}: loss "
             f"{record.loss:g}, gradient norm {record.grad_norm:g}; the update was skipped "
             "(params and optimizer state unchanged). Look for nonfinite_router_input alerts, "
             f"the data of this step ({source.batch_command}) and the learning rate.")
  return Alert(record.step, NONFINITE_STEP_RULE, message,
               {"loss": record.loss, "grad_norm": record.grad_norm,
                "data_position": source.data_position})


def loss_spike(record: StepRecord, sigma: float, window: int, source: BatchSource) -> Alert:
  """`loss_spike`: the step's loss or gradient norm was more than `sigma` deviations above the
  mean of its `window` recent applied steps (`record.spike`)."""
  spike = record.spike
  spiked = [f"{name} {value:.4g} (window mean {m:.4g}, deviation {d:.3g}, "
            f"{(value - m) / d if d else float('inf'):.1f} sigma)"
            for name, value, m, d in (("loss", record.loss, spike.mean[0], spike.std[0]),
                                      ("gradient norm", record.grad_norm, spike.mean[1],
                                       spike.std[1]))
            if value > m + sigma * d]
  message = (f"Train step spike [{SPIKE_RULE}] at step {record.step}: {'; '.join(spiked)} "
             f"above {sigma:g} sigma of the last {window} applied steps; the update was "
             f"skipped (params and optimizer state unchanged). Its batch: "
             f"{source.batch_command}.")
  return Alert(record.step, SPIKE_RULE, message, {
      "loss": record.loss, "grad_norm": record.grad_norm, "window_mean": list(spike.mean),
      "window_std": list(spike.std), "sigma": sigma, "data_position": source.data_position})


def factor_changed(step: int, old: float, new: float, decision: Decision) -> Alert:
  """`buffer_factor_changed`: from step `step` the autopilot runs `new` instead of `old`, for
  `decision` (with its program's memory per device, when known)."""
  evidence, memory_bytes = decision.evidence, decision.memory_bytes
  message = (f"MoE autopilot [{FACTOR_CHANGED_RULE}] at step {step}: ragged_buffer_factor "
             f"{old:g} -> {new:g} ({decision.reason}): {evidence.advice}" +
             (f" The new program needs {memory_bytes / 2**20:.1f} MiB per device."
              if memory_bytes else ""))
  return Alert(step, FACTOR_CHANGED_RULE, message, {
      "old_factor": old, "new_factor": new, "reason": decision.reason,
      "frequency": evidence.observed_recent_frequency,
      "required_factor": evidence.max_required_factor, "recommended_ragged_buffer_factor": new,
      "evidence": {**evidence._asdict(), "memory_bytes_per_device": memory_bytes}})
