"""benchmarks/chip_step.py's ballast bisection (`largest_ballast`), on the CPU with a stand-in
step that runs out of memory past a set ballast: it ends, to its resolution, whether the step
fits beside a little ballast, beside all the memory there is, or beside none (on the chip a
small program fits beside all of it, and the old bisection looped there for ever)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import chip_step

LIMIT, RESOLUTION = 256 << 20, 16 << 20


@pytest.mark.parametrize("room", [100 << 20, 2 * LIMIT, 0])
def test_the_ballast_bisection_finds_the_room_left_to_its_resolution(room):
  def step(state, batch):
    ballast = sum(a.nbytes for a in jax.live_arrays() if a.dtype == np.uint8)
    if ballast > room:
      raise jax.errors.JaxRuntimeError(f"RESOURCE_EXHAUSTED: ballast {ballast} > {room}")
    return state
  fits = chip_step.largest_ballast(step, lambda: jnp.zeros(()), None, LIMIT, RESOLUTION)
  assert fits == min(room, LIMIT) // RESOLUTION * RESOLUTION
