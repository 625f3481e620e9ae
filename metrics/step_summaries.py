"""A step's points as one TensorBoard `Summary`, written by CLU's SummaryWriter in one op.

CLU's `SummaryWriter.write_scalars` runs one eager TensorFlow summary op per tag (~0.4 ms of CPU
each: 27 tags took 13.4 ms a step as ops, 1.2 ms as one proto): with ~30 MoE and training tags a
step, that alone is ~3% of the default job's step on this machine. Here a step's scalars,
histograms and images become one `Summary` proto (values built in Python, as TensorBoard's own
`*_pb` helpers do) and reach the same event file through one
`tf.summary.experimental.write_raw_pb` op. The points are the ones `tf.summary.scalar` and CLU's
histogram and image writes produce: float32 scalars under the `scalars` plugin, `[buckets, 3]`
float64 tensors under the `histograms` plugin, and images as `[width, height, png]` string
tensors under the `images` plugin (PNG encoded here, with zlib: `tf.summary.image` spent ~40 ms
of TensorFlow ops per image on the default job).
"""
from __future__ import annotations

import struct
import zlib
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


def grey_png(image: np.ndarray) -> bytes:
  """PNG bytes of `image [H, W, 1]` (floats in [0, 1], as `tf.summary.image` takes them): 8-bit
  greyscale, each row unfiltered."""
  pixels = np.round(np.clip(np.asarray(image, np.float64)[..., 0], 0.0, 1.0) * 255).astype(np.uint8)
  height, width = pixels.shape
  rows = np.concatenate([np.zeros((height, 1), np.uint8), pixels], axis=1)  # filter byte 0
  def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
  header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8 bits, grey, no interlace
  return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) +
          chunk(b"IDAT", zlib.compress(rows.tobytes())) + chunk(b"IEND", b""))


def step_summary(scalars: Mapping[str, float], histograms: Mapping[str, np.ndarray],
                 buckets: int, images: Mapping[str, np.ndarray] | None = None
                 ) -> summary_pb2.Summary:
  """One step's points: each scalar as a float32 scalar summary; each histogram of `values
  [n]` binned into `buckets` buckets over [min, max] (TensorBoard's numpy histogram); each
  greyscale image `[H, W, 1]` in [0, 1] as a PNG. Raises TypeError or ValueError on a value
  that is not a number."""
  summary = summary_pb2.Summary()
  for tag, value in scalars.items():
    summary.value.add(tag=tag, metadata=_SCALAR_METADATA, tensor=tensor_pb2.TensorProto(
        dtype=types_pb2.DT_FLOAT, tensor_shape=_SCALAR_SHAPE, float_val=[float(value)]))
  for tag, values in histograms.items():
    summary.value.extend(histogram_summary.histogram_pb(
        tag, np.asarray(values, np.float64), buckets=buckets).value)
  for tag, image in (images or {}).items():
    height, width = np.shape(image)[:2]
    summary.value.add(tag=tag, metadata=_IMAGE_METADATA, tensor=tensor_pb2.TensorProto(
        dtype=types_pb2.DT_STRING, tensor_shape=_IMAGE_SHAPE,
        string_val=[str(width).encode(), str(height).encode(), grey_png(image)]))
  return summary


class StepSummaryWriter(metric_writers.SummaryWriter):
  """CLU's event-file writer, plus `write_step_summary`: a whole step's points in one op."""

  def write_step_summary(self, step: int, summary: summary_pb2.Summary) -> None:
    # `_summary_writer` is CLU's own `tf.summary` file writer, so the points join its file.
    with self._summary_writer.as_default():
      tf.summary.experimental.write_raw_pb(summary.SerializeToString(), step=step)
