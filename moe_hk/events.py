"""In-graph events: a MoE layer calls back to host functions registered here.

Two kinds of event, both from the layer's global (mesh-reduced, replicated) stats right after
its shard_map, so one callback per step and layer, not one per device:

* `FALLBACK_EVENT` (`moe_dropless_fallback_layers`), from the branch that fell back, only when
  it runs (`MoEConfig.emit_fallback_events`): the host learns of an overflow at once, while
  the step's stats wait on the device for the trainer's next fetch.
* `STEP_STATS_EVENT` (`moe_step_stats`), with `MoEConfig.stream_step_stats`: every step's
  stats when nothing fell back (capped or not), for users of the bare layer who have no train
  step returning them.

A rematerialised forward calls back again when it is recomputed under grad, and every process
reports, so events carry (step, layer, process) and the host keeps one record per
(step, layer). A model that stacks its layers can instead send every layer's fallback
events in one callback after them (`emit_stacked_fallback_events`): once per step, whatever
the remat. Haiku `init` emits nothing (the module passes no step). Each callback carries two
packed vectors (ints, floats): fewer host transfers per event.

`moe_hk` imports nothing outside itself: the host side (`metrics`) registers a sink.
"""
from __future__ import annotations

import functools
import threading
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

FALLBACK_EVENT = "moe_dropless_fallback_layers"  # emitted from the branch that fell back
STEP_STATS_EVENT = "moe_step_stats"              # the stats of a step that did not fall back


class LayerEvent(NamedTuple):
  """One report of one MoE layer in one step (numpy values)."""
  name: str          # FALLBACK_EVENT or STEP_STATS_EVENT.
  step: int
  layer: int         # 0-based ordinal among the model's MoE layers.
  process: int       # The reporting process (jax.process_index()).
  stats: tuple       # The layer's global `moe_hk.MoEStats` for the step, as numpy arrays.


_sinks: list[Callable[[LayerEvent], None]] = []
_sinks_lock = threading.Lock()


def add_sink(sink: Callable[[LayerEvent], None]) -> None:
  """Registers a host function that receives every `LayerEvent` (from any thread)."""
  with _sinks_lock:
    _sinks.append(sink)


def remove_sink(sink: Callable[[LayerEvent], None]) -> None:
  with _sinks_lock:
    _sinks.remove(sink)


def _pack(labels: list, stats: tuple) -> tuple[tuple, jax.Array, jax.Array]:
  """One int32 and one float32 vector holding the labels and every field (fewer host
  transfers per callback), and the static layout to unpack them: (is_float, shape) a field."""
  layout, ints, floats = [], [jnp.stack(labels).astype(jnp.int32)], []
  for value in stats:
    is_float = jnp.issubdtype(value.dtype, jnp.floating)
    layout.append((is_float, tuple(value.shape)))
    (floats if is_float else ints).append(value.reshape(-1))
  return (tuple(layout), jnp.concatenate(ints),
          jnp.concatenate(floats).astype(jnp.float32))


def _unpack(layout: tuple, ints, floats, labels: int) -> tuple[list[int], list[np.ndarray]]:
  """`_pack`'s inverse on the host: the first `labels` ints as Python ints, then the fields."""
  ints, floats = np.asarray(ints), np.asarray(floats)
  cursor, fields = {False: labels, True: 0}, []
  for is_float, shape in layout:
    size, source = int(np.prod(shape)), floats if is_float else ints
    fields.append(source[cursor[is_float]:cursor[is_float] + size].reshape(shape))
    cursor[is_float] += size
  return [int(v) for v in ints[:labels]], fields


def _send(event: LayerEvent) -> None:
  with _sinks_lock:
    sinks = list(_sinks)
  for sink in sinks:
    sink(event)


def _deliver(name: str, stats_type: type, layout: tuple, ints, floats) -> None:
  (step, layer, process), fields = _unpack(layout, ints, floats, labels=3)
  _send(LayerEvent(name, step, layer, process, stats_type(*fields)))


def _deliver_stacked(stats_type: type, layout: tuple, ints, floats) -> None:
  """One `FALLBACK_EVENT` per layer (row of the stacked fields) whose `fallback` is set."""
  (step, process), fields = _unpack(layout, ints, floats, labels=2)
  stats = stats_type(*fields)
  for layer in np.flatnonzero(stats.fallback):
    _send(LayerEvent(FALLBACK_EVENT, step, int(layer), process,
                     stats_type(*(field[layer] for field in fields))))


def emit_layer_event(stats: tuple, *, step: jax.Array, layer: jax.Array, process: int,
                     every_step: bool, can_fall_back: bool) -> None:
  """Calls back to the host with this layer's `MoEStats`: a `FALLBACK_EVENT` when
  `stats.fallback` is set, and, if `every_step`, a `STEP_STATS_EVENT` otherwise. A layer that
  cannot fall back (`can_fall_back` False: no fallback built, e.g. the worst-case buffer)
  sends its `STEP_STATS_EVENT` without a cond."""
  layout, ints, floats = _pack([step, layer, jnp.int32(process)], stats)
  def send(name):
    return lambda: jax.debug.callback(functools.partial(_deliver, name, type(stats), layout),
                                      ints, floats)
  if not can_fall_back:
    if every_step:
      send(STEP_STATS_EVENT)()
    return
  jax.lax.cond(stats.fallback > 0, send(FALLBACK_EVENT),
               send(STEP_STATS_EVENT) if every_step else lambda: None)


def emit_stacked_fallback_events(stats: tuple, *, step: jax.Array, process: int) -> None:
  """One callback for a whole model's MoE layers, when any fell back: `stats` holds every
  layer's `MoEStats` stacked (each field `[L, ...]`, row = the layer's ordinal). The host
  receives the same `FALLBACK_EVENT`s as from the layers themselves, one per layer that fell
  back. Called after the layers (outside any rematerialised forward), it fires once per step
  however many layers overflowed, where the layers' own events fire once per overflowing
  layer, and again when the backward recomputes them."""
  layout, ints, floats = _pack([step, jnp.int32(process)], stats)
  jax.lax.cond(jnp.any(stats.fallback > 0),
               lambda: jax.debug.callback(functools.partial(_deliver_stacked, type(stats), layout),
                                          ints, floats),
               lambda: None)
