"""Qwen3-MoE (`Qwen3MoeForCausalLM`): per-expert `mlp.experts.E.gate_proj/up_proj/down_proj`,
the router `mlp.gate`, per-head `self_attn.q_norm/k_norm`; `norm_topk_prob` says whether the
K chosen experts' weights are renormalised."""
from launch.hf.family import Family

FAMILY = Family(model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", moe="mlp",
                experts=("gate_proj", "up_proj", "down_proj"), router="gate",
                experts_field="num_experts", expert_width_field="moe_intermediate_size",
                qk_norm=True)
