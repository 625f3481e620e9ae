"""MoE observability: in-graph events, host aggregation, CLU/TensorBoard writers, alerts.

The writer pieces import CLU (and so TensorFlow); they load on first use, so that the layer,
which imports `metrics.emit`, stays light.
"""
import importlib

from metrics.aggregator import Aggregator, LayerRecord, StepMetrics
from metrics.alerts import Alert, AlertConfig, AlertManager
from metrics.emit import LayerEvent, add_sink, remove_sink

_LAZY = {"MoEMetrics": "metrics.pipeline", "worst_case_factor": "metrics.pipeline",
         "MoEMetricsWriter": "metrics.writer"}

__all__ = ["Aggregator", "Alert", "AlertConfig", "AlertManager", "LayerEvent", "LayerRecord",
           "StepMetrics", "add_sink", "remove_sink", *_LAZY]


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'metrics' has no attribute {name!r}")
