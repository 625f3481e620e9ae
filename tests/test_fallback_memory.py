"""Compiler-measured memory of the fallback (DESIGN.md §5), on a CPU mesh and a v5p topology.

One layer where token buffers dominate (8 shards, top-2, 8 experts, 64 x 512 tokens, emb 64,
MLP 128, factor 2): a value-and-grad step with the fallback must stay within 1.10 x the capped
step, and below both the naive unrolled chunk loop and the worst-case buffer.
"""
import pytest

from benchmarks import fallback_memory
from moe_hk import aot


@pytest.mark.slow
@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_fallback_memory_stays_at_capped_level(platform):
  if platform == "tpu":
    pytest.importorskip("libtpu", reason="needs the libtpu wheel matching jax (jax[tpu])")
  mib = {v: aot.total_memory_bytes(fallback_memory.compile_step(v, platform, layers=0)) / 2**20
         for v in fallback_memory.VARIANTS}
  assert mib["fallback_scan"] <= 1.10 * mib["capped"], mib
  assert mib["fallback_scan"] < mib["fallback_unrolled"], mib
  assert mib["fallback_scan"] < mib["worst_case"], mib
