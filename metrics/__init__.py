"""MoE observability on the host: aggregation, the factor rule and its evidence, CLU/TensorBoard
writers, alerts.

The layer's in-graph events live in `moe_hk.events` (the layer depends on nothing here); this
package registers itself as their sink. Every name loads on first use: the host-only modules
(`metrics.factor_rule`, `metrics.evidence`, `metrics.traffic`) import no jax, and the writer
pieces import CLU (and so TensorFlow).
"""
import importlib

_LAZY = {"Aggregator": "metrics.aggregator", "LayerRecord": "metrics.aggregator",
         "StepMetrics": "metrics.aggregator", "layer_record": "metrics.aggregator",
         "Alert": "metrics.alerts", "AlertConfig": "metrics.alerts",
         "AlertManager": "metrics.alerts", "Evidence": "metrics.evidence",
         "MoEMetrics": "metrics.pipeline", "MoEMetricsWriter": "metrics.writer"}

__all__ = list(_LAZY)


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'metrics' has no attribute {name!r}")
