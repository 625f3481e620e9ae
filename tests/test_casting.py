"""`moe_hk.casting`: `to_bfloat16` is bit for bit `astype(bfloat16)`, and `to_compute_dtype`
rounds float32 to bfloat16 through it."""
import jax
import jax.numpy as jnp
import numpy as np

from moe_hk import casting


def test_integer_rounding_equals_astype_bit_for_bit():
  rng = np.random.default_rng(0)
  values = np.concatenate([
      (rng.normal(size=10_000) * 10.0 ** rng.integers(-30, 30, size=10_000)).astype(np.float32),
      rng.integers(0, 2 ** 32, size=10_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
      # ties (exactly halfway between two bfloat16 values) both ways, extremes, zeros, infinities
      np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.3895314e38, 1e-45, 0.0, -0.0,
                np.inf, -np.inf], np.float32)])
  finite = ~np.isnan(values)
  ours = np.asarray(jax.jit(casting.to_bfloat16)(jnp.asarray(values)))
  expected = np.asarray(jnp.asarray(values).astype(jnp.bfloat16))
  assert ours.dtype == expected.dtype == jnp.bfloat16
  np.testing.assert_array_equal(ours[finite].view(np.uint16), expected[finite].view(np.uint16))
  assert np.isnan(ours[~finite].astype(np.float32)).all() and (~finite).sum() > 0


def test_to_compute_dtype_rounds_float32_to_bfloat16_through_integers():
  """float32 -> bfloat16 goes through `to_bfloat16` (integer ops in the program, no convert
  XLA could hoist) and equals `astype` bit for bit; other casts are `astype`."""
  x = jnp.asarray(np.random.default_rng(1).normal(size=1000).astype(np.float32))
  cast = casting.to_compute_dtype(x, jnp.bfloat16)
  assert cast.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(cast).view(np.uint16),
                                np.asarray(x.astype(jnp.bfloat16)).view(np.uint16))
  program = str(jax.make_jaxpr(lambda w: casting.to_compute_dtype(w, "bfloat16"))(x))
  assert "bitcast_convert_type" in program and "convert_element_type" not in program.replace(
      "convert_element_type[new_dtype=uint16", ""), program
  for dtype, source in (("float32", x), ("float32", x.astype(jnp.bfloat16)),
                        ("bfloat16", x.astype(jnp.bfloat16))):
    cast = casting.to_compute_dtype(source, dtype)
    assert cast.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(cast, source.astype(dtype))
