"""`Hooks`: the ordered list of what consumes the training loop's finished steps.

A consumer (`Hook`) reads each finished step's `StepRecord` (`on_step`) and each fetch's
`IntervalRecord` (`on_interval`); the loop hands every record to every registered consumer,
in the order they were added, and names none of them. Adding a consumer is one `add`. The
trainer's list, in order, is in `launch.run.trainer._hooks` (docs/design.md draws it).
"""
from __future__ import annotations

from launch.run.records import IntervalRecord, StepRecord


class Hook:
  """A consumer of finished steps; it overrides what it reads (both do nothing here)."""

  def on_step(self, record: StepRecord) -> None:
    """One finished step (every step of a fetch comes before the fetch's `on_interval`)."""

  def on_interval(self, interval: IntervalRecord) -> None:
    """One fetch's steps, after each went to every consumer's `on_step`."""


class Hooks:
  """Consumers in the order they receive each record."""

  def __init__(self):
    self._hooks: list[tuple[str, Hook]] = []

  def add(self, name: str, hook: Hook) -> Hook:
    """Registers `hook` after those already added; returns it. ValueError on a taken name."""
    if name in self.names():
      raise ValueError(f"Hooks.add({name!r}): a consumer of that name is registered; names: "
                       f"{', '.join(self.names())}.")
    self._hooks.append((name, hook))
    return hook

  def names(self) -> list[str]:
    """The consumers' names, in order."""
    return [name for name, _ in self._hooks]

  def step(self, record: StepRecord) -> None:
    for _, hook in self._hooks:
      hook.on_step(record)

  def interval(self, interval: IntervalRecord) -> None:
    for _, hook in self._hooks:
      hook.on_interval(interval)
