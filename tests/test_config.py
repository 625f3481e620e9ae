"""Config and mesh validation: bad values raise ValueError naming the value and the valid range."""
import dataclasses
import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_hk
from moe_hk import buffer_size

BASE = dict(num_experts=8, num_experts_per_tok=2, emb_dim=16, mlp_dim=32)


@pytest.mark.parametrize("changes,pattern", [
    (dict(num_experts=0), r"num_experts=0 .*positive integer"),
    (dict(num_experts_per_tok=9), r"num_experts_per_tok=9 .*\[1, num_experts=8\]"),
    (dict(emb_dim=-4), r"emb_dim=-4"),
    (dict(mlp_dim=2.5), r"mlp_dim=2.5"),
    (dict(ragged_buffer_factor=0), r"ragged_buffer_factor=0 .*-1 .* or > 0"),
    (dict(ragged_buffer_factor=-2), r"ragged_buffer_factor=-2"),
    (dict(ragged_buffer_factor=-0.5), r"ragged_buffer_factor=-0.5"),
    (dict(moe_dropless_fallback="always"),
     r"moe_dropless_fallback='always' .*'none', 'layer', 'step'"),
    (dict(a2a_impl="nccl"), r"a2a_impl='nccl' .*'auto', 'native', 'emulated'"),
    (dict(gmm_impl="cutlass"),
     r"gmm_impl='cutlass' .*'ragged_dot', 'blocked', 'megablox', 'tokamax'"),
    (dict(router_score="relu"), r"router_score='relu' .*'softmax', 'sigmoid'"),
    (dict(router_weights_on="both"), r"router_weights_on='both' .*'output', 'input'"),
    (dict(dtype="float16"), r"dtype='float16' .*'float32', 'bfloat16'"),
    (dict(dtype=jnp.int32), r"dtype=<class 'jax.numpy.int32'> .*'float32', 'bfloat16'"),
    (dict(dtype="nonsense"), r"dtype='nonsense' .*'float32', 'bfloat16'"),
    (dict(dropless_fallback_num_chunks=-1), r"dropless_fallback_num_chunks=-1"),
    (dict(dropless_fallback_chunking="dynamic"),
     r"dropless_fallback_chunking='dynamic' is invalid: .*'fixed', 'adaptive'"),
    (dict(load_balance_loss_weight=-0.1), r"load_balance_loss_weight=-0.1"),
    (dict(router_z_loss_weight=-1e-3), r"router_z_loss_weight=-0.001 is invalid: must be >= 0"),
])
def test_bad_values_name_field_value_and_range(changes, pattern):
  with pytest.raises(ValueError, match=pattern):
    moe_hk.MoEConfig(**{**BASE, **changes})


def test_good_values_accepted():
  for mode in ("none", "layer"):
    moe_hk.MoEConfig(**BASE, moe_dropless_fallback=mode)
  for ring in (False, True):  # 'step' runs on both paths
    moe_hk.MoEConfig(**BASE, moe_dropless_fallback="step", use_ring_of_experts=ring)
  moe_hk.MoEConfig(**BASE, ragged_buffer_factor=-1)
  moe_hk.MoEConfig(**BASE, ragged_buffer_factor=0.25)
  for chunking in ("fixed", "adaptive"):
    moe_hk.MoEConfig(**BASE, moe_dropless_fallback="layer", dropless_fallback_chunking=chunking)
  with pytest.raises(dataclasses.FrozenInstanceError):
    moe_hk.MoEConfig(**BASE).num_experts = 4


@pytest.mark.parametrize("dtype,name", [(jnp.float32, "float32"), (jnp.bfloat16, "bfloat16"),
                                        ("bfloat16", "bfloat16"), (np.dtype("float32"), "float32")])
def test_dtype_accepts_jnp_dtypes_and_names(dtype, name):
  config = moe_hk.MoEConfig(**BASE, dtype=dtype)
  assert config.dtype == name and config.compute_dtype == jnp.dtype(name)
  assert config == moe_hk.MoEConfig(**BASE, dtype=name)  # hashable, equal to the named form


def test_make_mesh_checks_device_count_and_axis_types():
  mesh = moe_hk.make_mesh(data=2, fsdp=1, expert=4)
  assert mesh.axis_names == ("data", "fsdp", "expert")
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  with pytest.raises(ValueError,
                     match=r"the mesh \(data=3, fsdp=1, expert=2\) needs 6 devices; there are 8"):
    moe_hk.make_mesh(data=3, expert=2)
  with pytest.raises(ValueError, match=r"expert=0"):
    moe_hk.make_mesh(expert=0)


def _params(config):
  return moe_hk.MoEParams(
      jnp.zeros((config.emb_dim, config.num_experts)),
      jnp.zeros((config.num_experts, config.emb_dim, config.mlp_dim)),
      jnp.zeros((config.num_experts, config.emb_dim, config.mlp_dim)),
      jnp.zeros((config.num_experts, config.mlp_dim, config.emb_dim)))


def _forward(config, mesh, shape):
  x = jnp.zeros(shape, jnp.float32)
  return jax.jit(functools.partial(moe_hk.moe_forward, config=config, mesh=mesh))(
      _params(config), x)


@pytest.mark.parametrize("mesh_args,config_changes,shape,pattern", [
    (dict(data=2, expert=4), dict(num_experts=6), (8, 4, 16),
     r"num_experts=6 must be divisible by the size of mesh axis 'expert' \(4\)"),
    (dict(data=2, expert=4), dict(expert_axis="experts"), (8, 4, 16),
     r"expert_axis='experts' is not an axis of the mesh"),
    (dict(data=2, expert=4), {}, (12, 4, 16), r"batch 12 must be divisible by the 8 devices"),
    (dict(data=2, expert=4), {}, (8, 4, 32), r"width 32 .* must equal MoEConfig.emb_dim=16"),
    (dict(data=2, expert=4), {}, (8, 16), r"must be \[batch, seq, emb_dim\]"),
    (dict(fsdp=8), dict(emb_dim=12), (8, 4, 12), r"emb_dim=12 must be divisible .*'fsdp' \(8\)"),
    (dict(data=2, expert=4), dict(ragged_buffer_factor=0.01), (8, 4, 16),
     r"ragged_buffer_factor=0.01 leaves a receive buffer of 0 rows for 8 routed rows"),
])
def test_mesh_and_input_errors(mesh_args, config_changes, shape, pattern):
  config = moe_hk.MoEConfig(**{**BASE, **config_changes})
  with pytest.raises(ValueError, match=pattern):
    _forward(config, moe_hk.make_mesh(**mesh_args), shape)


@pytest.mark.parametrize("axes,changes,pattern", [
    (("data", "model"), {},
     r"expert_axis='expert' is not an axis of the mesh \(axes: data, model\)"),
    (("data", "expert"), dict(num_experts=6),
     r"num_experts=6 must be divisible by the size of mesh axis 'expert' \(4\)"),
])
def test_bare_layer_checks_its_mesh_before_creating_parameters(axes, changes, pattern):
  """Haiku init of the bare layer on a mesh that does not fit: the project's ValueError, not
  jax's sharding errors from the parameter initializers. (The mesh is built in the test, not
  at collection: `make test-tpu` collects this module on a one-chip host.)"""
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(2, 4), axes)
  config = moe_hk.MoEConfig(**{**BASE, **changes})
  model = hk.transform_with_state(lambda x: moe_hk.MoELayer(config, mesh, name="moe")(x))
  with pytest.raises(ValueError, match=pattern):
    model.init(jax.random.key(0), jnp.zeros((8, 4, 16)))


def test_dropless_fallback_is_the_default():
  assert moe_hk.MoEConfig(**BASE).layer_fallback


def _jaxpr(config, factor, **kw):
  """The layer's program with `ragged_buffer_factor=factor`, events on (a step is given)."""
  config = config.replace(ragged_buffer_factor=factor)
  layer = functools.partial(moe_hk.moe_forward, config=config,
                            mesh=moe_hk.make_mesh(data=2, expert=4), step=0, **kw)
  return str(jax.make_jaxpr(layer)(_params(config), jnp.zeros((8, 4, 16))))


def test_worst_case_buffer_builds_no_fallback():
  """The default fallback costs nothing with the worst-case buffer: no overflow check, no
  cond (the layer's events included) is built; a capped buffer builds them."""
  config = moe_hk.MoEConfig(**BASE)
  assert "cond[" not in _jaxpr(config, -1)
  assert "cond[" not in _jaxpr(config, 100.0)  # above the worst case: the worst case
  assert "cond[" not in _jaxpr(config, 1.0, force_dropless=True)
  assert "cond[" in _jaxpr(config, 1.0)  # the check can fail


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.uint8, jnp.bool_])
@pytest.mark.parametrize("haiku", [False, True], ids=["moe_forward", "MoELayer"])
def test_non_float_input_is_refused(dtype, haiku):
  """One line naming the dtype (called outside jit: jit appends its traceback note)."""
  config, mesh = moe_hk.MoEConfig(**BASE), moe_hk.make_mesh(data=2, expert=4)
  x = jnp.zeros((8, 4, 16), dtype)
  name = jnp.dtype(dtype).name
  with pytest.raises(ValueError, match=rf"^MoE input dtype {name} is not supported: the layer "
                                       r"takes float32 or bfloat16 input only\.$"):
    if haiku:
      model = hk.transform_with_state(lambda x: moe_hk.MoELayer(config, mesh, name="moe")(x))
      model.init(jax.random.key(0), x)
    else:
      moe_hk.moe_forward(_params(config), x, config=config, mesh=mesh)


def test_native_all_to_all_refused_on_cpu():
  config = moe_hk.MoEConfig(**BASE, a2a_impl="native")
  with pytest.raises(ValueError, match=r"a2a_impl='native' cannot run on a CPU mesh"):
    _forward(config, moe_hk.make_mesh(data=2, expert=4), (8, 4, 16))


def test_buffer_rows_formula():
  # N = T * K = 64; worst case P * T * min(K, L).
  assert buffer_size.buffer_rows(4, 32, 2, 2, -1) == 4 * 32 * 2
  assert buffer_size.buffer_rows(4, 32, 2, 2, 0.5) == 32
  assert buffer_size.buffer_rows(4, 32, 2, 2, 1.3) == 83   # floor(64 * 1.3)
  assert buffer_size.buffer_rows(4, 32, 2, 2, 100.0) == 256  # capped at the worst case
  assert buffer_size.buffer_rows(8, 16, 4, 1, -1) == 8 * 16 * 1  # min(K, L) = 1
  # The worst case equals N * min(P, E / K).
  for p, t, k, l in [(8, 16, 2, 1), (4, 8, 1, 4), (2, 5, 4, 2), (8, 3, 2, 16)]:
    assert buffer_size.worst_case_rows(p, t, k, l) == t * k * min(p, p * l / k)
    assert buffer_size.worst_case_factor(p * l, k, p) == min(p, p * l / k)
  # -1 stands for the worst case's factor; any other factor for itself.
  assert buffer_size.factor_in_force(-1, 4.0) == 4.0
  assert buffer_size.factor_in_force(1.5, 4.0) == 1.5


def test_the_checked_choices_are_what_the_code_acts_on():
  """`launch.setup.choices` lists the values the settings accept; the model's remat policies are
  exactly those (a policy added to one and not the other fails here)."""
  from launch.model import transformer
  from launch.setup import choices
  assert tuple(transformer.REMAT_POLICIES) == choices.REMAT_POLICIES
