"""MoE observability on the host: aggregation, CLU/TensorBoard writers, alerts.

The layer's in-graph events live in `moe_hk.events` (the layer depends on nothing here); this
package registers itself as their sink. The writer pieces import CLU (and so TensorFlow);
they load on first use.
"""
import importlib

from metrics.aggregator import Aggregator, LayerRecord, StepMetrics, layer_record
from metrics.alerts import Alert, AlertConfig, AlertManager

_LAZY = {"MoEMetrics": "metrics.pipeline", "MoEMetricsWriter": "metrics.writer"}

__all__ = ["Aggregator", "Alert", "AlertConfig", "AlertManager", "LayerRecord", "StepMetrics",
           "layer_record", *_LAZY]


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'metrics' has no attribute {name!r}")
