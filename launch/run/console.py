"""What an operator reads on the terminal: a few lines a run, written by process 0.

    compiling the train step (the first step runs when it is compiled) ...
    first step: 23.4 s (compilation included)
    step 119 (120/200) | loss 2.031 | 9.1k tok/s | 0.44 s/step | 0.0153 TFLOP/s/dev | fallback 3/10
        steps | factor 2 | ETA 0:00:35    (one line)
    done: steps 0-199 in 0:01:40 | loss 1.874 (eval 1.902) | fallback in 12% of steps | ...

Progress comes once per fetch of the steps' outputs (`config.log_every` steps), from the
fetched values: it costs no extra device round trip.
"""
from __future__ import annotations

import datetime
import sys
from typing import NamedTuple, TextIO

import jax


def duration(seconds: float) -> str:
  """`H:MM:SS`."""
  return str(datetime.timedelta(seconds=round(max(seconds, 0.0))))


def rate(value: float) -> str:
  """`9.1k`, `12.3M`: three significant figures at most."""
  for scale, unit in ((1e6, "M"), (1e3, "k")):
    if value >= scale:
      return f"{value / scale:.3g}{unit}"
  return f"{value:.3g}"


class Interval(NamedTuple):
  """The steps of one fetch, as the progress line reports them."""
  last_step: int          # 0-based index of the interval's last step
  loss: float             # its training loss
  seconds_per_step: float | None   # None for the interval that compiled the step
  tokens_per_second: float | None
  fallback_steps: int     # steps of the interval in which a MoE layer fell back
  steps: int              # steps in the interval
  dropped_rows: int       # rows dropped in the interval (only without a fallback)
  skipped_steps: int      # steps skipped for a non-finite loss or gradient
  factor: float           # the ragged_buffer_factor in force at its last step
  tflops_per_device: float | None = None  # the model's TFLOP/s per device (None: not timed)
  mfu: float | None = None                # model FLOPs utilisation (None: no known peak)
  spike_steps: int = 0                    # steps skipped as loss or gradient-norm spikes
  stopping: bool = False  # the run stops after it (signal, stop_after, non-finite): no ETA


class Console:
  """Lines for the operator; silent on every process but 0."""

  def __init__(self, total_steps: int, stream: TextIO | None = None):
    self.total_steps = total_steps
    self._stream = stream or sys.stdout
    self._on = jax.process_index() == 0

  def line(self, text: str) -> None:
    if self._on:
      print(text, file=self._stream, flush=True)

  def progress(self, i: Interval) -> None:
    """`step 119 (120/200) | loss 2.031 | ...`: the interval's last step (0-based, as
    everywhere) and the steps done of the run's; the ETA assumes the interval's speed
    (the interval that compiled the step, or one cut short by a stop, shows neither; the
    interval the run stops after shows no ETA)."""
    done = i.last_step + 1
    fields = [f"step {i.last_step} ({done}/{self.total_steps})", f"loss {i.loss:.4g}"]
    if i.seconds_per_step is not None:
      fields += [f"{rate(i.tokens_per_second)} tok/s", f"{i.seconds_per_step:.3g} s/step"]
      if i.tflops_per_device is not None:
        fields.append(f"{i.tflops_per_device:.3g} TFLOP/s/dev")
      if i.mfu is not None:
        fields.append(f"MFU {i.mfu:.1%}")
    fields.append(f"fallback {i.fallback_steps}/{i.steps} steps")
    if i.dropped_rows:
      fields.append(f"dropped {i.dropped_rows} rows")
    if i.skipped_steps:
      fields.append(f"skipped {i.skipped_steps} non-finite")
    if i.spike_steps:
      fields.append(f"skipped {i.spike_steps} spikes")
    fields.append(f"factor {i.factor:g}")
    if i.seconds_per_step is not None and not i.stopping:
      fields.append(f"ETA {duration((self.total_steps - done) * i.seconds_per_step)}")
    self.line(" | ".join(fields))
