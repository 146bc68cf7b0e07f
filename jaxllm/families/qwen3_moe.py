"""Qwen3-MoE (transformers' ``Qwen3MoeForCausalLM``): Qwen3's attention (query/key norms) with a mixture of experts
in every layer but those of ``mlp_only_layers`` (a dense MLP of ``intermediate_size``), its top k renormalized or not
(``model.moe_router_pre_softmax``), the layers' kinds in ``model.moe_layer_freq``."""

from jaxllm.errors import ConvertError
from jaxllm.families import llama, mixtral
from jaxllm.families.tables import Arch, Family

PRESET = {**llama.PRESET, "qk_layernorm": True}


def _qwen3_moe_keys(hf: dict, keys: dict) -> dict:
    """Qwen3-MoE's routing and layer kinds as model keys: ``norm_topk_prob`` false (transformers'
    default: the softmax over all experts, its top k not renormalized) is ``model.moe_router_pre_softmax``;
    layer ``i`` is a mixture of experts unless in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``
    (transformers' ``Qwen3MoeDecoderLayer``), one 0/1 per layer in ``model.moe_layer_freq`` (``1``: every
    layer).  Raises ConvertError for a ``decoder_sparse_step`` or ``mlp_only_layers`` transformers cannot
    have built."""
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1:
        raise ConvertError(f"config.json: decoder_sparse_step={step!r} is not supported: jaxllm needs an "
                           f"integer >= 1", keys=("decoder_sparse_step",))
    if not all(isinstance(i, int) for i in dense):
        raise ConvertError(f"config.json: mlp_only_layers={dense!r} is not supported: jaxllm needs a list of "
                           f"layer indices", keys=("mlp_only_layers",))
    moe = [i not in dense and (i + 1) % step == 0 for i in range(keys["num_layers"])]
    return {"moe_router_pre_softmax": not hf.get("norm_topk_prob", False),
            "moe_layer_freq": "1" if all(moe) else "[" + ",".join(str(int(x)) for x in moe) + "]"}


# Qwen3-MoE: Qwen3's attention with a mixture of experts in every layer but those of mlp_only_layers (which
# keep a dense MLP of intermediate_size); the defaults are transformers' Qwen3MoeConfig's
QWEN3_MOE = Arch(
    model_type="qwen3_moe", hf_class="Qwen3MoeForCausalLM",
    needs={**mixtral.MOE_NEEDS, "qk_layernorm": True, "sliding_window": 0},  # and num_experts > 0 (misfits)
    keys={**llama.QWEN_KEYS, "num_hidden_layers": ("num_layers", 24), "hidden_size": ("hidden_size", 2048),
          "num_key_value_heads": ("num_kv_heads", 4), "intermediate_size": ("ffn_hidden_size", 6144),
          "moe_intermediate_size": ("moe_ffn_hidden_size", 768), "num_experts": ("num_experts", 128),
          "num_experts_per_tok": ("moe_router_topk", 8), "router_aux_loss_coef": ("moe_aux_loss_coeff", 0.001)},
    aliases={"num_local_experts": "num_experts"},  # what transformers' to_dict writes (its attribute_map)
    supports={"hidden_act": ("silu",), "attention_bias": (False,), "use_sliding_window": (False,)},
    extra=lambda m: {"head_dim": m.head_dim, "attention_dropout": 0.0, "sliding_window": None,
                     "norm_topk_prob": not m.moe_router_pre_softmax, "decoder_sparse_step": 1,
                     "mlp_only_layers": [i for i, moe in enumerate(m.moe_layers) if not moe],
                     "output_router_logits": False, **llama.rope_parameters(m)},
    **llama.FILES,
    tensors=(*llama.QWEN3_ATTENTION, *llama.MLP, *mixtral.expert_rows("mlp", "gate_proj", "up_proj", "down_proj"),
             *llama.OUTPUT),
    layouts=mixtral.fused_experts("mlp", "gate_proj", "up_proj", "down_proj"),
    derive=_qwen3_moe_keys,
    misfits=mixtral.needs_experts,
    likely=lambda m: bool(m.num_experts) and m.qk_layernorm)


FAMILY = Family(
    name="qwen3_moe", preset=PRESET, architectures=(QWEN3_MOE,),
    megatron_args={"moe_layer_freq": ((1, None), "every layer must be a mixture of experts when one is")},
    # Qwen/Qwen3-30B-A3B config.json: 32 heads of 128 (kv_channels: 4096 wide, not hidden / heads); intermediate_size
    # 6144 is the dense layers' FFN, of which mlp_only_layers [] leaves none; 30.53B parameters, 3.35B active
    sizes={"Qwen3-30B-A3B": llama.shape(48, 2048, 32, 4, 6144, 151936, 40960, 1e6, qk_layernorm=True, norm_eps=1e-6,
                                        kv_channels=128, num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
                                        moe_aux_loss_coeff=0.001)})
