"""Reading back what the writers wrote: TensorBoard event files as plain Python values.

For checks and benchmarks (what a run logged, step by step), without a TensorBoard server. Each
reader takes a run folder or a workdir (whose run folder it reads: `metrics.run_folder.run_dir`).
CLU's writers store scalars, histograms and images as tensor summaries; each reader returns
`tag -> {step: value}` for one summary kind.
"""
from __future__ import annotations

import os

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from metrics.run_folder import EVENTS, run_dir


def _accumulator(logdir: str) -> EventAccumulator:
  """The events of `logdir`: a run folder, or a workdir (its run folder, `run_dir`)."""
  if not any(name.startswith(EVENTS) for name in os.listdir(logdir)):
    logdir = run_dir(logdir)
  return EventAccumulator(logdir, size_guidance={"tensors": 0})


def _events(logdir: str, plugin: str) -> dict[str, list]:
  """tag -> its tensor events, for the tags whose summaries belong to `plugin`."""
  acc = _accumulator(logdir)
  acc.Reload()
  return {tag: acc.Tensors(tag) for tag in acc.Tags()["tensors"]
          if acc.SummaryMetadata(tag).plugin_data.plugin_name == plugin}


def read_scalar_points(logdir: str) -> dict[str, dict[int, tuple[float, float]]]:
  """tag -> {step: (wall time in seconds, value)} of every scalar in `logdir`."""
  return {tag: {e.step: (e.wall_time, tensor_util.make_ndarray(e.tensor_proto).item())
                for e in events}
          for tag, events in _events(logdir, "scalars").items()}


def read_scalars(logdir: str) -> dict[str, dict[int, float]]:
  """tag -> {step: value} of every scalar in `logdir`."""
  return {tag: {step: value for step, (_, value) in points.items()}
          for tag, points in read_scalar_points(logdir).items()}


def read_histograms(logdir: str) -> dict[str, dict[int, np.ndarray]]:
  """tag -> {step: [n, 3] buckets (left edge, right edge, count)}."""
  return {tag: {e.step: tensor_util.make_ndarray(e.tensor_proto) for e in events}
          for tag, events in _events(logdir, "histograms").items()}


def read_images(logdir: str) -> dict[str, dict[int, np.ndarray]]:
  """tag -> {step: [H, W, C] uint8} of every image summary in `logdir`."""
  import tensorflow as tf  # CLU's writers depend on it already; only images need it here
  return {tag: {e.step: tf.io.decode_png(tensor_util.make_ndarray(e.tensor_proto)[2]).numpy()
                for e in events}
          for tag, events in _events(logdir, "images").items()}


def has_hparams(logdir: str) -> bool:
  """Whether `logdir` holds a TensorBoard HParams summary."""
  acc = _accumulator(logdir)
  acc.Reload()
  return any(t.startswith("_hparams_") for t in acc.Tags()["tensors"])
