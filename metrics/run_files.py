"""A run folder's TensorBoard event files: the run's own, and one run per series of the
buffer-factor chart inside it (`metrics.tags.FACTOR_SERIES`).

Each file's first point of a tag carries the tag's description (`metrics.tags.description`);
TensorBoard reads a tag's metadata from its first point, so later points go without. The run
file also holds the CUSTOM SCALARS layout (`metrics.tags.LAYOUT`), written at step 0.
"""
from __future__ import annotations

import os
from typing import Mapping

import numpy as np
from tensorboard.plugins.custom_scalar import summary as custom_scalar

from metrics import expert_load, tags
from metrics.step_summaries import StepSummaryWriter, step_summary


class RunFiles:
  """The event files of the run in `logdir` (process 0 writes them)."""

  def __init__(self, logdir: str):
    self.run = StepSummaryWriter(logdir)
    self.series = {name: StepSummaryWriter(os.path.join(logdir, name))
                   for name in tags.FACTOR_SERIES}
    self._described: dict[str, set[str]] = {name: set() for name in ("", *self.series)}
    self.run.write_step_summary(0, custom_scalar.pb(tags.LAYOUT))

  def _descriptions(self, writer: str, names) -> dict[str, str]:
    """Descriptions of the tags among `names` that `writer` ('' for the run) has not yet
    described."""
    described = self._described[writer]
    new = {name: text for name in names if name not in described
           and (text := tags.description(name)) is not None}
    described.update(names)
    return new

  def write(self, step: int, scalars: Mapping[str, float],
            histograms: Mapping[str, np.ndarray], loads: Mapping[str, tuple[np.ndarray, int]],
            buckets: int) -> None:
    """One step's points: the run's summary (images drawn from `loads`: tag -> (rows per
    expert [layers, E], the interval's first step)), then each factor series' point."""
    images = {tag: expert_load.render(load, first, step) for tag, (load, first) in loads.items()}
    names = [*scalars, *histograms, *images]
    self.run.write_step_summary(step, step_summary(
        scalars, histograms, buckets, images, self._descriptions("", names)))
    for name, source in tags.FACTOR_SERIES.items():
      if source in scalars:
        point = {tags.FACTOR_SERIES_TAG: scalars[source]}
        self.series[name].write_step_summary(step, step_summary(
            point, {}, buckets, descriptions=self._descriptions(name, point)))

  def flush(self) -> None:
    for writer in (self.run, *self.series.values()):
      writer.flush()

  def close(self) -> None:
    for writer in (self.run, *self.series.values()):
      writer.close()
