"""The `moe/expert_load` heatmap: MoE layers x experts, each cell an expert's rows over its
layer's fair share, drawn with labelled axes, a colour scale and the interval in the title.

Rendered with matplotlib's Agg canvas (no pyplot state, so it is safe on the writer's
background thread) into PNG bytes that join the step's summary (`metrics.step_summaries`).
"""
from __future__ import annotations

import io

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

# Load over the fair share is drawn on [0, 2]: 1 (fair) in the middle of a diverging map, so
# cold experts are blue, hot ones red; everything at or above 2x is the darkest red.
COLORMAP = "RdBu_r"
LOAD_RANGE = (0.0, 2.0)
WIDTH_PIXELS = 720
DPI = 100


def relative_load(tokens_per_expert: np.ndarray) -> np.ndarray:
  """`tokens_per_expert [layers, E]` (rows over an interval) -> rows over each layer's fair
  share (its mean per expert); a layer with no rows is 0 throughout."""
  load = np.asarray(tokens_per_expert, np.float64)
  fair = load.mean(axis=1, keepdims=True)
  return np.divide(load, fair, out=np.zeros_like(load), where=fair > 0)


def render(tokens_per_expert: np.ndarray, first_step: int, last_step: int) -> bytes:
  """PNG of `tokens_per_expert [layers, E]` summed over steps `first_step`..`last_step`: a
  heatmap with MoE layers on the vertical axis, experts on the horizontal one, a colour bar
  of rows / fair share, and the steps in the title."""
  load = relative_load(tokens_per_expert)
  layers, experts = load.shape
  height = 1.6 + 0.28 * layers
  figure = Figure(figsize=(WIDTH_PIXELS / DPI, height), dpi=DPI, layout="constrained")
  axes = figure.add_subplot()
  image = axes.imshow(load, cmap=COLORMAP, vmin=LOAD_RANGE[0], vmax=LOAD_RANGE[1],
                      aspect="auto", interpolation="nearest")
  axes.set_xlabel("expert")
  axes.set_ylabel("MoE layer")
  axes.set_yticks(range(layers))
  axes.set_xticks(range(0, experts, max(1, experts // 16)))
  steps = f"step {last_step}" if first_step == last_step else f"steps {first_step}-{last_step}"
  axes.set_title(f"expert load, {steps}: rows / fair share (max {load.max():.2f}x)",
                 fontsize=10)
  figure.colorbar(image, ax=axes, label="rows / fair share", fraction=0.05, pad=0.02)
  buffer = io.BytesIO()
  FigureCanvasAgg(figure).print_png(buffer)
  return buffer.getvalue()
