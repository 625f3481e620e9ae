"""The MoE TensorBoard tags in one place: their names, what each says (written into the event
files as the tag's description), and the CUSTOM SCALARS layout that charts them.

`<i>` in a tag is the 0-based ordinal among MoE layers. The buffer-factor chart draws three
series: the factor in force, the factor this step's traffic needed and the factor rule's
recommendation. TensorBoard colours the lines of a chart by run, so each series is also
written, under the one tag `FACTOR_SERIES_TAG`, into a run of its own inside the run folder
(`FACTOR_SERIES`: `<run>/buffer_factor/in_force`, ...): the chart then shows three colours,
each line named by its run.
"""
from __future__ import annotations

import re

from tensorboard.plugins.custom_scalar import layout_pb2

FALLBACK_LAYERS_TAG = "learning/moe_dropless_fallback_layers"
FREQUENCY_TAG = "moe/fallback_frequency"
REQUIRED_FACTOR_TAG = "moe/required_ragged_buffer_factor"
DROPPED_FRACTION_TAG = "moe/dropped_rows_fraction"
RECOMMENDED_FACTOR_TAG = "moe/recommended_ragged_buffer_factor"
FACTOR_IN_FORCE_TAG = "moe/ragged_buffer_factor"  # the trainer's: the factor its program runs
LB_LOSS_TAG = "moe/lb_loss"
Z_LOSS_TAG = "moe/z_loss"
LOAD_MAX_OVER_MEAN_TAG = "moe/load_max_over_mean"
DEAD_EXPERTS_TAG = "moe/dead_experts"
ROUTER_ENTROPY_TAG = "moe/router_entropy"
FALLBACK_CHUNKS_TAG = "moe/fallback_chunks"
NONFINITE_TOKENS_TAG = "moe/nonfinite_tokens"
DROPLESS_STEPS_TAG = "moe/dropless_steps"
TOKENS_PER_EXPERT_TAG = "moe/tokens_per_expert"
EXPERT_LOAD_TAG = "moe/expert_load"
FACTOR_SERIES_TAG = "moe/buffer_factor"

# Series of the buffer-factor chart: run folder (inside the run's) -> the tag it mirrors.
FACTOR_SERIES = {
    "buffer_factor/in_force": FACTOR_IN_FORCE_TAG,
    "buffer_factor/required": REQUIRED_FACTOR_TAG,
    "buffer_factor/recommended": RECOMMENDED_FACTOR_TAG,
}

_FACTOR = ("Buffer factors are receive-buffer rows over the balanced rows (tokens x top-k per "
           "expert shard); the worst case is min(expert shards, experts / top-k).")
# Tag (per-layer tags without their '/layer_<i>') -> its description.
DESCRIPTIONS = {
    FALLBACK_LAYERS_TAG: "MoE layers whose dropless fallback ran this step (count). A layer "
                         "falls back when some expert shard would receive more rows than its "
                         "capped buffer holds; it then runs dropless in chunks, nothing lost.",
    FREQUENCY_TAG: "Fraction of the trailing window's steps (default 100) in which at least "
                   "one MoE layer fell back. The factor rule keeps this at or below its target "
                   "(default 1%).",
    REQUIRED_FACTOR_TAG: "Buffer factor this step's traffic needed: the largest receiving "
                         "shard's rows over the balanced rows, max over MoE layers. Above the "
                         "factor in force, the step overflowed. " + _FACTOR,
    DROPPED_FRACTION_TAG: "Rows dropped / rows routed this step (0 when the fallback ran or "
                          "the buffer is the worst case; above 0 only without a fallback).",
    RECOMMENDED_FACTOR_TAG: "The factor rule's answer on the trailing window: the smallest "
                            "factor (steps of 1/8) that would have fallen back on at most the "
                            "target fraction of steps, or a measured faster one; no point "
                            "while the window is too short to name one. " + _FACTOR,
    FACTOR_IN_FORCE_TAG: "ragged_buffer_factor of the program this step ran (the config's, or "
                         "the autopilot's latest switch). " + _FACTOR,
    LB_LOSS_TAG: "Load-balance loss, weighted, summed over MoE layers (Switch style: E x "
                 "fraction routed x mean router probability per expert).",
    Z_LOSS_TAG: "Router z-loss, weighted, summed over MoE layers (mean squared log-sum-exp of "
                "the router logits).",
    LOAD_MAX_OVER_MEAN_TAG: "Busiest expert's rows over the mean rows per expert, this layer "
                            "and step (1 = perfectly balanced).",
    DEAD_EXPERTS_TAG: "Experts of this layer that received no row this step (count).",
    ROUTER_ENTROPY_TAG: "Mean entropy of this layer's router softmax over experts, in nats "
                        "(ln E when uniform; falling towards 0 as the router grows sure).",
    FALLBACK_CHUNKS_TAG: "Chunks this layer's dropless fallback ran in this step (0: it did "
                         "not fall back).",
    NONFINITE_TOKENS_TAG: "Tokens whose router logits were NaN or inf this step: routed to no "
                          "expert, their output NaN (bad input, not an overflow).",
    DROPLESS_STEPS_TAG: "Step mode: steps so far that ran every MoE layer from the first "
                        "overflowing one on the dropless path.",
    TOKENS_PER_EXPERT_TAG: "Histogram over this layer's experts of the rows each received this "
                           "step.",
    EXPERT_LOAD_TAG: "Heatmap, MoE layers x experts: rows each expert received over the log "
                     "interval, divided by the layer's fair share (mean per expert); 1 is fair.",
    FACTOR_SERIES_TAG: "The buffer-factor chart's series, one run each: in force (the "
                       "program's), required (this step's traffic, max over layers), "
                       "recommended (the factor rule). " + _FACTOR,
}

_PER_LAYER = re.compile(r"/layer_\d+$")


def description(tag: str) -> str | None:
  """The description of `tag` (a per-layer tag's is its family's); None for tags that are not
  the MoE telemetry's."""
  return DESCRIPTIONS.get(_PER_LAYER.sub("", tag))


def _chart(title: str, *tags: str) -> layout_pb2.Chart:
  return layout_pb2.Chart(title=title, multiline=layout_pb2.MultilineChartContent(
      tag=[f"^{t}$" for t in tags]))


# TensorBoard's CUSTOM SCALARS tab: the factor story first, each quantity on its own axes.
LAYOUT = layout_pb2.Layout(category=[layout_pb2.Category(title="MoE buffer factor", chart=[
    _chart("ragged_buffer_factor: in force, required, recommended (one run each)",
           FACTOR_SERIES_TAG),
    _chart("fallback frequency (fraction of the trailing window's steps)", FREQUENCY_TAG),
    _chart("MoE layers that fell back (this step)", FALLBACK_LAYERS_TAG),
    _chart("rows dropped / rows routed (this step)", DROPPED_FRACTION_TAG),
    layout_pb2.Chart(title="required factor per MoE layer", multiline=(
        layout_pb2.MultilineChartContent(tag=[rf"^{REQUIRED_FACTOR_TAG}/layer_\d+$"]))),
])])
