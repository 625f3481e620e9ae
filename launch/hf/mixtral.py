"""Mixtral (`MixtralForCausalLM`): per-expert `block_sparse_moe.experts.E.w1/w3/w2` (gate, up,
down), the router `block_sparse_moe.gate`; the K chosen experts' weights renormalised."""
from launch.hf.family import Family

FAMILY = Family(model_type="mixtral", architecture="MixtralForCausalLM",
                moe="block_sparse_moe", experts=("w1", "w3", "w2"), router="gate",
                experts_field="num_local_experts", expert_width_field="intermediate_size",
                qk_norm=False)
