"""The forms the library's fallback is measured against, and the seam that traces a layer
with them: never modes users pick.

`traced_with(fn, chunk_loop=..., ladder=...)` runs every trace of `fn` inside
`moe_hk.fallback._comparison_forms`, so the MoE layers it traces use the given chunk loop
(`moe_hk.fallback.unrolled_chunks`, the naive form) or adaptive ladder (`two_rung_ladder`)
instead of the library's `scan_chunks` and `traffic_ladder`.
"""
from __future__ import annotations

import functools
from typing import Callable

from moe_hk import fallback
from moe_hk.fallback import Rung


def two_rung_ladder(*, seq: int, capped_rows: int, worst_rows: int, max_chunks: int
                    ) -> tuple[Rung, ...]:
  """The ladder adaptive chunking had before `traffic_ladder`: the smallest divisor p > 1 of
  `max_chunks`, with the capped buffer (or its worst case if smaller), then
  `fallback.fixed_rung` (8 -> p = 2; 7 -> none)."""
  del seq
  fixed = fallback.fixed_rung(capped_rows=capped_rows, worst_rows=worst_rows,
                              max_chunks=max_chunks)
  p = next((d for d in range(2, max_chunks) if max_chunks % d == 0), None)
  if p is None:
    return (fixed,)
  return (Rung(p, min(capped_rows, worst_rows // p)), fixed)


def traced_with(fn: Callable, **forms) -> Callable:
  """`fn`, whose MoE layers trace with `forms` (`chunk_loop=`, `ladder=`) when it is traced."""
  if not forms:
    return fn

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with fallback._comparison_forms(**forms):  # the seam is for this module
      return fn(*args, **kwargs)
  return wrapped
