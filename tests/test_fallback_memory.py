"""Compiler-measured memory of the fallback (DESIGN.md §5), on a CPU mesh and a v5p topology.

One layer where token buffers dominate (8 shards, top-2, 8 experts, 64 x 512 tokens, emb 64,
MLP 128, factor 2): a value-and-grad step with the fallback must stay within 1.10 x the capped
step, and below both the naive unrolled chunk loop and the worst-case buffer.
"""
import functools

import jax
import pytest

from benchmarks import fallback_memory
from moe_hk import aot

PLATFORMS = ["cpu", "tpu"]
JAX_012 = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12)


@functools.lru_cache(maxsize=None)
def _mib(platform: str) -> dict:
  if platform == "tpu":
    pytest.importorskip("libtpu", reason="needs the libtpu wheel matching jax (jax[tpu])")
  return {v: aot.total_memory_bytes(fallback_memory.compile_step(v, platform, layers=0)) / 2**20
          for v in fallback_memory.VARIANTS}


@pytest.mark.slow
@pytest.mark.parametrize("platform", PLATFORMS)
def test_fallback_memory_below_naive_loop_and_worst_case(platform):
  mib = _mib(platform)
  assert mib["fallback_scan"] < mib["fallback_unrolled"], mib
  assert mib["fallback_scan"] < mib["worst_case"], mib


@pytest.mark.slow
@pytest.mark.parametrize("platform", [
    "cpu",
    pytest.param("tpu", marks=pytest.mark.xfail(
        JAX_012, strict=True,
        reason="TPU compiler of jax 0.12 (libtpu 0.0.50): the checkpointed chunk scan alone "
               "takes 52.4 MiB and the fallback 57.0 MiB against 32.0 MiB capped (1.78x); "
               "jax 0.10.2 (libtpu 0.0.42.1) gives 61.5 vs 62.0 MiB. Open, see README.")),
])
def test_fallback_memory_within_ten_percent_of_capped(platform):
  mib = _mib(platform)
  assert mib["fallback_scan"] <= 1.10 * mib["capped"], mib
