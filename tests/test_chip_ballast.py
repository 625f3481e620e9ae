"""benchmarks/chip_step.py's ballast search (`largest_ballast`), on the CPU with a stand-in
step that runs out of memory past a set ballast: it ends, to its resolution, whether the step
fits beside a little ballast, beside all the memory there is, or beside none (on the chip a
small program fits beside all of it, and an old bisection looped there for ever), and whatever
it was told to try first; told right, it runs the step at most three times. And its command
line refuses a memory case it does not have in one line."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import chip_step

LIMIT, RESOLUTION = 256 << 20, 16 << 20
ROOMS = {"a little": 100 << 20, "all of it": 2 * LIMIT, "none": 0}
GUESSES = {"none": lambda room: None, "right": lambda room: room,
           "low": lambda room: room - 7 * RESOLUTION, "high": lambda room: room + 5 * RESOLUTION,
           "past the limit": lambda room: 3 * LIMIT}


@pytest.mark.parametrize("guess", GUESSES)
@pytest.mark.parametrize("room", ROOMS)
def test_the_ballast_search_finds_the_room_left_to_its_resolution(room, guess):
  room, tries = ROOMS[room], []

  def step(state, batch):
    ballast = sum(a.nbytes for a in jax.live_arrays() if a.dtype == np.uint8)
    tries.append(ballast)
    if ballast > room:
      raise jax.errors.JaxRuntimeError(f"RESOURCE_EXHAUSTED: ballast {ballast} > {room}")
    return state
  fits = chip_step.largest_ballast(step, lambda: jnp.zeros(()), None, LIMIT, RESOLUTION,
                                   guess=GUESSES[guess](room))
  assert fits == min(room, LIMIT) // RESOLUTION * RESOLUTION
  if guess == "right":
    assert len(tries) <= 3, tries


def test_an_unknown_memory_case_is_refused_in_one_line_naming_the_cases():
  with pytest.raises(SystemExit) as refused:
    chip_step.main(["chip_step", "--memory=capped,ballast"])
  assert str(refused.value) == ("chip_step: --memory=capped,ballast: ballast is no memory case; "
                                "the cases are capped, fallback, worst_case")
