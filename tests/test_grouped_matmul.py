"""Grouped SwiGLU experts (blocked, ragged_dot, megablox, tokamax) against a per-row dense
reference."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import moe_hk
from moe_hk import expert_rows, grouped_matmul, megablox
from tests.moe_inputs import outputs_and_grads, reference_outputs_and_grads, skewed_inputs
from tests.tree_close import assert_trees_close


def _dense_reference(x, wi_0, wi_1, wo, group_sizes):
  """Each row times its own group's weights; rows past the groups give zero."""
  ends = np.cumsum(group_sizes)
  group = np.searchsorted(ends, np.arange(x.shape[0]), side="right")
  valid = group < len(group_sizes)
  g = np.minimum(group, len(group_sizes) - 1)
  h = jax.nn.silu(jnp.einsum("md,mdf->mf", x, wi_0[g])) * jnp.einsum("md,mdf->mf", x, wi_1[g])
  return jnp.einsum("mf,mfd->md", h, wo[g]) * valid[:, None]


def _value_and_grads(fn, x, wi_0, wi_1, wo, sizes, cot):
  """`fn(x, wi_0, wi_1, wo, sizes)` and the gradients of `sum(fn(...) * cot)` in the four."""
  loss = lambda *a: jnp.sum(fn(*a, sizes) * cot)
  return fn(x, wi_0, wi_1, wo, sizes), jax.grad(loss, argnums=(0, 1, 2, 3))(x, wi_0, wi_1, wo)


@functools.lru_cache(maxsize=None)
def _compiled_mlp(impl: str, block_rows: int):
  """The jitted `_value_and_grads` of one backend, group sizes an argument: the cases of one
  backend share it (one worker runs them, tests/conftest.py WORKER_GROUPS)."""
  # interpret: megablox in Pallas's interpreter, tokamax on its XLA reference (CPU).
  mlp = functools.partial(grouped_matmul.expert_mlp, impl=impl, block_rows=max(block_rows, 1),
                          interpret=True)
  return jax.jit(functools.partial(_value_and_grads, mlp))


@pytest.mark.parametrize("impl,block_rows", [
    ("blocked", 1), ("blocked", 3), ("blocked", 8), ("blocked", 128), ("ragged_dot", 0),
    ("megablox", 0), ("tokamax", 0)])
@pytest.mark.parametrize("group_sizes", [
    [5, 0, 7, 2], [0, 0, 0, 0], [20, 0, 0, 0], [1, 1, 1, 13], [0, 24, 0, 0]])
def test_expert_mlp_matches_per_row_reference(impl, block_rows, group_sizes):
  rng = np.random.default_rng(sum(group_sizes))
  rows, d, f, g = 24, 6, 10, len(group_sizes)  # rows past sum(group_sizes) are padding.
  x, wi_0, wi_1, wo = (jnp.asarray(rng.normal(size=s), jnp.float32)
                       for s in [(rows, d), (g, d, f), (g, d, f), (g, f, d)])
  sizes = jnp.asarray(group_sizes, jnp.int32)
  cot = jnp.asarray(rng.normal(size=(rows, d)), jnp.float32)
  y, grads = _compiled_mlp(impl, block_rows)(x, wi_0, wi_1, wo, sizes, cot)
  y_ref, grads_ref = _value_and_grads(_dense_reference, x, wi_0, wi_1, wo, sizes, cot)
  assert_trees_close(y, y_ref, what="y")
  for name, a, b in zip(["dx", "dwi_0", "dwi_1", "dwo"], grads, grads_ref):
    if name == "dx" and impl == "megablox":  # undefined on padding rows (grouped_rows below)
      a, b = a[:sum(group_sizes)], b[:sum(group_sizes)]
    if np.linalg.norm(b) == 0:
      np.testing.assert_array_equal(a, 0, err_msg=name)  # an empty group gets a zero gradient
    else:
      assert_trees_close(a, b, what=name)
  np.testing.assert_array_equal(np.asarray(y)[sum(group_sizes):], 0)  # padding rows are zero


def test_tile_levels_halve_then_end_with_a_masked_tail():
  L = grouped_matmul.Level
  assert grouped_matmul.tile_levels(128, 4096) == (
      L(128, False), L(64, False), L(32, False), L(16, False), L(16, True))
  assert grouped_matmul.tile_levels(6, 4096) == (L(6, False), L(3, False), L(3, True))
  assert grouped_matmul.tile_levels(128, 24) == (  # never wider than the rows
      L(24, False), L(12, False), L(6, False), L(3, False), L(3, True))


def test_tiling_covers_each_group_with_one_short_masked_tail():
  levels = grouped_matmul.tile_levels(6, 16)  # 6, 3, then a masked tail of 3
  tiles = grouped_matmul.tiling(jnp.array([5, 0, 7, 2], jnp.int32), levels)
  np.testing.assert_array_equal(tiles.group_start, [0, 5, 5, 12])
  np.testing.assert_array_equal(tiles.group_end, [5, 5, 12, 14])
  # 5 = 3 + tail 2; 0 = nothing; 7 = 6 + tail 1; 2 = tail 2.
  np.testing.assert_array_equal(tiles.level_count, [[0, 1, 1], [0, 0, 0], [1, 0, 1], [0, 0, 1]])
  np.testing.assert_array_equal(tiles.level_start, [[0, 0, 3], [0, 0, 0], [0, 6, 6], [0, 0, 0]])


@pytest.mark.parametrize("block_rows", [1, 5, 8, 64])
@pytest.mark.parametrize("seed", range(4))
def test_tiles_cover_every_grouped_row_exactly_once(block_rows, seed):
  rng = np.random.default_rng(seed)
  rows, g = 50, 5
  sizes = rng.multinomial(rng.integers(0, rows + 1), rng.dirichlet(np.full(g, 0.5)))
  levels = grouped_matmul.tile_levels(block_rows, rows)
  tiles = jax.tree.map(np.asarray, grouped_matmul.tiling(jnp.asarray(sizes, jnp.int32), levels))
  for group in range(g):
    covered = []
    for v, level in enumerate(levels):
      for i in range(tiles.level_count[group, v]):
        first = tiles.group_start[group] + tiles.level_start[group, v] + i * level.rows
        last = first + level.rows
        if level.masked:  # only the rest of its group, less than a whole tile
          assert 0 < tiles.group_end[group] - first < level.rows
          last = tiles.group_end[group]
        assert last <= tiles.group_end[group]
        covered.extend(range(first, last))
    np.testing.assert_array_equal(covered, np.arange(tiles.group_start[group],
                                                     tiles.group_end[group]))


def test_padding_rows_never_reach_outputs_or_gradients():
  rng = np.random.default_rng(0)
  sizes = jnp.array([1, 16], jnp.int32)  # the tail tile of group 1 slides back from the end
  lhs = rng.normal(size=(20, 5)).astype(np.float32)
  lhs[17:] = np.nan  # padding rows
  rhs = jnp.asarray(rng.normal(size=(2, 5, 7)), jnp.float32)
  loss = lambda a, w: jnp.sum(grouped_matmul.blocked_grouped_matmul(a, w, sizes, 6) ** 2)
  value, (dlhs, drhs) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(jnp.asarray(lhs), rhs)
  clean = np.where(np.isnan(lhs), 0, lhs)
  want_value, (want_dlhs, want_drhs) = jax.value_and_grad(loss, argnums=(0, 1))(
      jnp.asarray(clean), rhs)
  assert_trees_close((value, dlhs, drhs), (want_value, want_dlhs, want_drhs), what="nan pad")


def test_bfloat16_keeps_dtypes():
  rng = np.random.default_rng(1)
  sizes = jnp.array([9, 0, 23], jnp.int32)
  lhs = jnp.asarray(rng.normal(size=(40, 16)), jnp.bfloat16)
  rhs = jnp.asarray(rng.normal(size=(3, 16, 8)), jnp.bfloat16)
  cot = jnp.asarray(rng.normal(size=(40, 8)), jnp.bfloat16)

  def value_and_grads(a, w):
    loss = lambda a, w: jnp.sum(grouped_matmul.blocked_grouped_matmul(a, w, sizes, 8) * cot)
    return grouped_matmul.blocked_grouped_matmul(a, w, sizes, 8), jax.grad(loss, (0, 1))(a, w)
  got = jax.jit(value_and_grads)(lhs, rhs)
  assert [x.dtype for x in jax.tree.leaves(got)] == [jnp.bfloat16] * 3
  f32 = lambda t: t.astype(jnp.float32)
  want = value_and_grads(f32(lhs), f32(rhs))
  assert_trees_close(jax.tree.map(f32, got), want, rtol=2e-2, what="bf16")


@pytest.mark.parametrize("block_rows", [1, 4, 6, 64])
def test_blocked_grouped_matmul_single_product(block_rows):
  rng = np.random.default_rng(block_rows)
  sizes = np.array([3, 0, 9, 4])
  lhs = jnp.asarray(rng.normal(size=(20, 5)), jnp.float32)
  rhs = jnp.asarray(rng.normal(size=(4, 5, 7)), jnp.float32)
  group = np.minimum(np.searchsorted(np.cumsum(sizes), np.arange(20), side="right"), 3)
  want = jnp.einsum("mk,mkn->mn", lhs, rhs[group]) * (np.arange(20) < sizes.sum())[:, None]
  got = jax.jit(grouped_matmul.blocked_grouped_matmul, static_argnums=3)(
      lhs, rhs, jnp.asarray(sizes), block_rows)
  assert_trees_close(got, want, what="blocked gmm")


@pytest.mark.parametrize("dtype,rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_megablox_spans_tiles_and_ignores_padding_rows(dtype, rtol, monkeypatch):
  """Three row tiles of 512 (groups crossing tile edges, an empty group), a width past one
  tile that is not a tile multiple (D=160, the width tiles held to 128 here: the interpreter
  takes a minute at the chip's 1024), and non-finite padding rows: the kernels leave rows
  past the groups unwritten, so this checks that the output is masked there and that nothing
  of the padding rows reaches the rows in groups or the weight gradients."""
  monkeypatch.setattr(megablox, "WIDTH_TILES", (128,))
  rng = np.random.default_rng(3)
  sizes = jnp.array([530, 0, 900], jnp.int32)
  rows, d, f = 3 * 512, 160, 256
  assert megablox.tiling(rows, d, f, 4) == (512, 128, 128)
  x = rng.normal(size=(rows, d)).astype(np.float32)
  x[1430:] = np.nan
  clean = np.where(np.isnan(x), 0, x)
  wi_0, wi_1, wo = (rng.normal(size=s).astype(np.float32) / np.sqrt(s[1])
                    for s in [(3, d, f), (3, d, f), (3, f, d)])
  cot = jnp.asarray(rng.normal(size=(rows, d)), jnp.float32)  # nonzero on padding rows too

  def value_and_grads(fn, *args):
    loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * cot)
    return fn(*args), jax.grad(loss, argnums=(0, 1, 2, 3))(*args)
  mlp = lambda *a: grouped_matmul.expert_mlp(*a, sizes, impl="megablox", interpret=True)
  got = jax.jit(functools.partial(value_and_grads, mlp))(
      *(jnp.asarray(a, dtype) for a in (x, wi_0, wi_1, wo)))
  assert [a.dtype for a in jax.tree.leaves(got)] == [dtype] * 5
  got = jax.tree.map(lambda a: np.asarray(a, np.float32), got)
  np.testing.assert_array_equal(got[0][1430:], 0)
  as_dtype = lambda a: jnp.asarray(jnp.asarray(a, dtype), jnp.float32)  # same rounded inputs
  want = value_and_grads(lambda *a: _dense_reference(*a, np.asarray(sizes)),
                         *(as_dtype(a) for a in (clean, wi_0, wi_1, wo)))
  in_groups = lambda tree: (tree[0], (tree[1][0][:1430], *tree[1][1:]))  # dx: undefined past
  assert_trees_close(in_groups(got), in_groups(want), rtol=rtol,
                     what=f"megablox {jnp.dtype(dtype).name}")


@pytest.mark.parametrize("shape,itemsize,tiles", [
    ((32768, 2048, 2816), 2, (512, 1024, 1024)),  # the chip config's experts, bfloat16
    ((32768, 2048, 2816), 4, (512, 1024, 512)),   # float32: (512, 1024, 1024) needs 18 MiB
    ((1408, 64, 96), 4, (128, 64, 96)),           # 1300 rows padded to 128s; narrow widths
    ((112, 32, 64), 2, (112, 32, 64)),            # fewer rows than a tile: all of them
])
def test_megablox_tiles_are_the_largest_that_fit_vmem(shape, itemsize, tiles):
  assert megablox.tiling(*shape, itemsize) == tiles
  assert megablox.vmem_bytes(tiles, itemsize) <= megablox.VMEM_BUDGET
  assert megablox.vmem_bytes((1024, 1024, 1024), 2) > megablox.VMEM_BUDGET  # out of VMEM


@pytest.mark.parametrize("rows,tile", [(100, 112), (600, 128), (1000, 512), (1300, 128),
                                       (32768, 512), (3 * 256, 256)])
def test_megablox_row_tile_pads_at_most_an_eighth(rows, tile):
  assert megablox.row_tile(rows) == tile
  padded = -(-rows // tile) * tile
  assert padded - rows <= max(rows // 8, 15) and megablox.tiling(padded, 64, 64, 2)[0] % 16 == 0
  assert padded % megablox.tiling(padded, 64, 64, 2)[0] == 0  # the kernels' rows divide


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_tokamax_ignores_nonfinite_padding_rows(dtype):
  """tokamax's Mosaic GPU kernels leave rows past the groups unwritten and mask the weight
  gradient's rows by multiplying, so the wrapper selects every product's rows there to 0.
  On CPU tokamax runs its XLA reference under the same wrapper: NaN padding rows in x and a
  cotangent that is nonzero there must reach neither the output, nor the rows in groups, nor
  the weight gradients, and x's gradient is 0 on padding rows. Tolerance per leaf: 1e-5 in
  float32; 2e-2 in bfloat16 (three matmuls with rounded products against a float32
  reference from the same rounded inputs)."""
  rng = np.random.default_rng(7)
  sizes = np.array([9, 0, 14, 5])  # an empty group; 28 of 40 rows in groups
  rows, d, f = 40, 16, 24
  x = rng.normal(size=(rows, d)).astype(np.float32)
  x[28:] = np.nan
  clean = np.where(np.isnan(x), 0, x)
  wi_0, wi_1, wo = (rng.normal(size=s).astype(np.float32) / np.sqrt(s[1])
                    for s in [(4, d, f), (4, d, f), (4, f, d)])
  cot = jnp.asarray(rng.normal(size=(rows, d)), jnp.float32)

  def value_and_grads(fn, *args):
    loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * cot)
    return fn(*args), jax.grad(loss, argnums=(0, 1, 2, 3))(*args)
  mlp = lambda *a: grouped_matmul.expert_mlp(*a, jnp.asarray(sizes, jnp.int32), impl="tokamax",
                                             interpret=True)
  got = jax.jit(functools.partial(value_and_grads, mlp))(
      *(jnp.asarray(a, dtype) for a in (x, wi_0, wi_1, wo)))
  assert [a.dtype for a in jax.tree.leaves(got)] == [dtype] * 5
  got = jax.tree.map(lambda a: np.asarray(a, np.float32), got)
  np.testing.assert_array_equal(got[0][28:], 0)     # output
  np.testing.assert_array_equal(got[1][0][28:], 0)  # x's gradient
  np.testing.assert_array_equal(got[1][1][1], 0)    # the empty group's weights
  as_dtype = lambda a: jnp.asarray(jnp.asarray(a, dtype), jnp.float32)  # same rounded inputs
  want = value_and_grads(lambda *a: _dense_reference(*a, sizes),
                         *(as_dtype(a) for a in (clean, wi_0, wi_1, wo)))
  assert_trees_close(got, want, rtol=1e-5 if dtype == jnp.float32 else 2e-2,
                     what=f"tokamax {jnp.dtype(dtype).name}")


def test_tokamax_weight_gradients_sum_over_the_shards_that_share_them():
  """Inside the layer's shard_map (vma check on) each shard multiplies its own rows by its
  expert shard's weights, which the `data` axis replicates: the weight gradients are the sum
  over the shards that hold the same weights. tokamax's kernels return values that vary over
  no mesh axis, so the wrapper's backward marks and sums them itself."""
  mesh = jax.make_mesh((2, 4), ("data", "expert"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rng = np.random.default_rng(11)
  rows, d, f, local = 12, 8, 16, 2    # per shard: 12 rows, 2 local experts (8 in all)
  sizes = rng.integers(0, 6, size=(8, local))  # per shard (data-major), sums <= 12
  x, cot = (jnp.asarray(rng.normal(size=(8 * rows, d)), jnp.float32) for _ in range(2))
  wi_0, wi_1, wo = (jnp.asarray(rng.normal(size=s), jnp.float32)
                    for s in [(8, d, f), (8, d, f), (8, f, d)])
  shard = P(("data", "expert"))

  def local_mlp(x, wi_0, wi_1, wo, sizes):
    return grouped_matmul.expert_mlp(x, wi_0, wi_1, wo, sizes[0], impl="tokamax",
                                     interpret=True)
  layer = jax.shard_map(local_mlp, mesh=mesh, out_specs=shard, check_vma=True,
                        in_specs=(shard, P("expert"), P("expert"), P("expert"), shard))

  def reference(x, wi_0, wi_1, wo, sizes):  # shard s = (data i, expert j): experts 2j, 2j + 1
    return jnp.concatenate([
        _dense_reference(x[s * rows:(s + 1) * rows], *(w[2 * (s % 4):2 * (s % 4) + 2]
                                                        for w in (wi_0, wi_1, wo)), sizes[s])
        for s in range(8)])
  got = jax.jit(functools.partial(_value_and_grads, layer))(
      x, wi_0, wi_1, wo, jnp.asarray(sizes, jnp.int32), cot)
  want = _value_and_grads(reference, x, wi_0, wi_1, wo, sizes, cot)
  assert_trees_close(got, want, what="tokamax in shard_map")


@pytest.mark.slow
def test_tokamax_layer_fallback_equals_dropless():
  """The layer with gmm_impl='tokamax' (its XLA reference on the CPU mesh) on a case whose
  capped buffer overflows, so the `layer` fallback runs: outputs and every gradient equal
  the dropless dense reference (tests/test_fallback.py's grid, one case, on the ring path:
  the quicker of the two to compile)."""
  mesh = moe_hk.make_mesh(data=4, expert=2)
  config = moe_hk.MoEConfig(num_experts=4, num_experts_per_tok=2, emb_dim=16, mlp_dim=32,
                            ragged_buffer_factor=0.4, gmm_impl="tokamax",
                            use_ring_of_experts=True, moe_dropless_fallback="layer",
                            dropless_fallback_chunking="fixed")
  params, x = skewed_inputs(config, 16, 16, skew=1.5, seed=4)
  cot = jax.random.normal(jax.random.key(3), x.shape)
  layer = functools.partial(moe_hk.moe_forward, config=config, mesh=mesh)
  y, stats, grads = jax.jit(functools.partial(outputs_and_grads, layer))(params, x, cot)
  y_ref, _, grads_ref = reference_outputs_and_grads(params, x, cot, k=2)
  assert int(stats.would_drop_rows) > 0, "the case must really overflow the capped buffer"
  assert int(stats.fallback) == 1 and int(stats.dropped_rows) == 0
  assert_trees_close(y, y_ref, what="y")
  assert_trees_close(grads, grads_ref, what="grad")


def test_tokamax_is_refused_on_a_tpu_mesh():
  config = moe_hk.MoEConfig(num_experts=8, num_experts_per_tok=2, emb_dim=16, mlp_dim=32,
                            gmm_impl="tokamax")
  tpu = type("TpuDevice", (), {"platform": "tpu"})()
  fake = type("Mesh", (), {"devices": np.array([tpu])})()
  with pytest.raises(ValueError, match=r"gmm_impl='tokamax' .*GPU .*not on a tpu mesh"):
    moe_hk.mesh_forward.resolve_backends(config, fake)
  cpu = moe_hk.mesh_forward.resolve_backends(config, moe_hk.make_mesh(data=4, expert=2))
  assert (cpu.gmm, cpu.interpret) == ("tokamax", True)  # CPU: tokamax's XLA reference


def test_grouped_rows_cut_padding_rows_off_the_gradient():
  """The paths gather the grouped matmul's rows with `grouped_rows`: rows past the groups
  come out 0, and their cotangent (NaN here, as megablox may leave it) never reaches the
  source."""
  source = jnp.arange(18, dtype=jnp.float32).reshape(6, 3)
  index, sizes = jnp.array([4, 0, 5, 2]), jnp.array([1, 1], jnp.int32)
  rows, pullback = jax.vjp(lambda s: expert_rows.grouped_rows(s, index, sizes), source)
  np.testing.assert_array_equal(rows, np.stack([source[4], source[0], np.zeros(3), np.zeros(3)]))
  (grad,) = pullback(jnp.array([[1.0] * 3, [2.0] * 3, [np.nan] * 3, [np.nan] * 3]))
  want = np.zeros((6, 3))
  want[4], want[0] = 1.0, 2.0
  np.testing.assert_array_equal(grad, want)


@pytest.mark.parametrize("copies", [1, 2])
def test_take_rows_backward_is_the_gathers_transpose_by_a_gather(copies):
  """`take_rows` moves a permutation's rows (each source row `copies` times) and back by
  gathers: forward and gradient equal the plain gather's and its scatter-add transpose's;
  rows from `kept` on come out 0 and their cotangent (NaN here) reaches no source row. The
  control: with the inverse permutation off by one, the gradient differs."""
  rng = np.random.default_rng(0)
  source = jnp.asarray(rng.normal(size=(6, 3)), jnp.float32)
  index = jnp.asarray(rng.permutation(6 * copies), jnp.int32)
  inverse = expert_rows.inverse_permutation(index)
  kept = 6 * copies - 2
  cotangent = jnp.asarray(rng.normal(size=(6 * copies, 3)), jnp.float32).at[kept:].set(np.nan)
  rows, pullback = jax.vjp(
      lambda s: expert_rows.take_rows(s, index, inverse, jnp.int32(kept), copies), source)
  want_rows, want_pullback = jax.vjp(lambda s: s[index[:kept] // copies], source)
  np.testing.assert_array_equal(rows[:kept], want_rows)
  np.testing.assert_array_equal(rows[kept:], 0)
  np.testing.assert_allclose(pullback(cotangent)[0], want_pullback(cotangent[:kept])[0],
                             rtol=1e-6)
  shifted = jnp.roll(inverse, 1)
  _, wrong = jax.vjp(
      lambda s: expert_rows.take_rows(s, index, shifted, jnp.int32(6 * copies), copies), source)
  _, right = jax.vjp(lambda s: s[index // copies], source)
  clean = cotangent.at[kept:].set(1.0)
  assert not np.allclose(wrong(clean)[0], right(clean)[0])
