"""A step's points as one TensorBoard `Summary`, written by CLU's SummaryWriter in one op.

CLU's `SummaryWriter.write_scalars` runs one eager TensorFlow summary op per tag (~0.4 ms of CPU
each: 27 tags took 13.4 ms a step as ops, 1.2 ms as one proto): with ~30 MoE and training tags a
step, that alone is ~3% of the default job's step on this machine. Here a step's scalars,
histograms and images become one `Summary` proto (values built in Python, as TensorBoard's own
`*_pb` helpers do) and reach the same event file through one
`tf.summary.experimental.write_raw_pb` op. The points are the ones `tf.summary.scalar` and CLU's
histogram and image writes produce: float32 scalars under the `scalars` plugin, `[buckets, 3]`
float64 tensors under the `histograms` plugin, and images as `[width, height, png]` string
tensors under the `images` plugin (PNGs made by the caller: `tf.summary.image` spent ~40 ms of
TensorFlow ops per image on the default job).
"""
from __future__ import annotations

import struct
from typing import Mapping

import numpy as np
import tensorflow as tf
from clu import metric_writers
from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
from tensorboard.plugins.histogram import summary as histogram_summary
from tensorboard.plugins.image import metadata as image_metadata
from tensorboard.plugins.scalar import metadata as scalar_metadata

_SCALAR_METADATA = scalar_metadata.create_summary_metadata(display_name=None, description=None)
_SCALAR_SHAPE = tensor_shape_pb2.TensorShapeProto()
_IMAGE_METADATA = image_metadata.create_summary_metadata(display_name=None, description=None)
_IMAGE_SHAPE = tensor_shape_pb2.TensorShapeProto(
    dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=3)])  # width, height, PNG


def png_size(png: bytes) -> tuple[int, int]:
  """(width, height) of a PNG, from its header chunk."""
  return struct.unpack(">II", png[16:24])


def _metadata(default: summary_pb2.SummaryMetadata, plugin, description: str | None
              ) -> summary_pb2.SummaryMetadata:
  """`default`, or the plugin's metadata carrying `description` (TensorBoard reads a tag's
  description from its first point, so only that one needs it)."""
  if description is None:
    return default
  return plugin.create_summary_metadata(display_name=None, description=description)


def step_summary(scalars: Mapping[str, float], histograms: Mapping[str, np.ndarray],
                 buckets: int, images: Mapping[str, bytes] | None = None,
                 descriptions: Mapping[str, str] | None = None) -> summary_pb2.Summary:
  """One step's points: each scalar as a float32 scalar summary; each histogram of `values
  [n]` binned into `buckets` buckets over [min, max] (TensorBoard's numpy histogram); each
  image given as PNG bytes. Tags in `descriptions` carry theirs. Raises TypeError or
  ValueError on a value that is not a number."""
  summary = summary_pb2.Summary()
  described = descriptions or {}
  for tag, value in scalars.items():
    metadata = _metadata(_SCALAR_METADATA, scalar_metadata, described.get(tag))
    summary.value.add(tag=tag, metadata=metadata, tensor=tensor_pb2.TensorProto(
        dtype=types_pb2.DT_FLOAT, tensor_shape=_SCALAR_SHAPE, float_val=[float(value)]))
  for tag, values in histograms.items():
    summary.value.extend(histogram_summary.histogram_pb(
        tag, np.asarray(values, np.float64), buckets=buckets,
        description=described.get(tag)).value)
  for tag, png in (images or {}).items():
    width, height = png_size(png)
    metadata = _metadata(_IMAGE_METADATA, image_metadata, described.get(tag))
    summary.value.add(tag=tag, metadata=metadata, tensor=tensor_pb2.TensorProto(
        dtype=types_pb2.DT_STRING, tensor_shape=_IMAGE_SHAPE,
        string_val=[str(width).encode(), str(height).encode(), png]))
  return summary


class StepSummaryWriter(metric_writers.SummaryWriter):
  """CLU's event-file writer, plus `write_step_summary`: a whole step's points in one op."""

  def write_step_summary(self, step: int, summary: summary_pb2.Summary) -> None:
    # `_summary_writer` is CLU's own `tf.summary` file writer, so the points join its file.
    with self._summary_writer.as_default():
      tf.summary.experimental.write_raw_pb(summary.SerializeToString(), step=step)
