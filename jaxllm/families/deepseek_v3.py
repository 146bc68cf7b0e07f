"""DeepSeek-V3 (DeepSeek-AI 2024, arXiv:2412.19437; transformers' ``DeepseekV3ForCausalLM``) and the models of its
architecture (Moonlight): multi-head latent attention (``model.multi_latent_attention``; DeepSeek's interleaved
rotary rows), the first ``first_k_dense_replace`` layers a dense MLP, the rest a mixture of experts routed by sigmoid
score with an expert bias (``e_score_correction_bias``), groups, a scaled top k and shared experts; YaRN's rotary
scaling (rope type ``yarn``, :data:`YARN_ROPE`: ``model.rope_type="yarn"``, DeepSeek-V3's own config.json) and its
multi-token prediction modules (``num_nextn_predict_layers``: ``model.mtp_num_layers``, the checkpoint's
``model.layers.{num_hidden_layers + k}``), both ways."""

import re
from typing import Any

import numpy as np

from jaxllm import config
from jaxllm.families import llama, mixtral
from jaxllm.families.tables import VEC, Arch, Condition, Family, RopeType, Tensor, refuse
from jaxllm.model import rotary

PRESET = {**llama.PRESET, "multi_latent_attention": True}


def _rotary_rows(m: config.Model) -> dict[str, tuple[int, int]]:
    """The HF tensors whose rows hold rotary dimensions, as ``name: (rows per block, rotary rows at its end)``:
    each head's query rows (``q_proj`` or ``q_b_proj``, ``dn + dr`` per head) and ``kv_a_proj_with_mqa``'s
    shared rotary key (its last ``dr`` of ``kv_lora + dr``)."""
    dr, dq = m.qk_pos_emb_head_dim, m.qk_head_dim + m.qk_pos_emb_head_dim
    return {"q_b_proj" if m.q_lora_rank else "q_proj": (dq, dr), "kv_a_proj_with_mqa": (m.kv_lora_rank + dr, dr)}


def _interleave(tensors: dict[str, np.ndarray], m: config.Model, *, to_hf: bool) -> dict[str, np.ndarray]:
    """DeepSeek's rotary layout (``rope_interleave``, transformers' default) from jaxllm's or back: its checkpoints
    rotate neighbouring pairs ``(2j, 2j + 1)``, jaxllm (and HF Llama) the halves ``(j, j + dr/2)``, so jaxllm's
    rotary row ``j`` is HF's ``2j`` for ``j < dr/2``, else ``2(j - dr/2) + 1`` (transformers'
    ``apply_rotary_pos_emb_interleave``, which de-interleaves the same way).  Other rows and tensors unchanged."""
    rows = _rotary_rows(m)
    out = dict(tensors)
    for k, x in tensors.items():
        proj = re.fullmatch(r".*layers\.\d+\.self_attn\.(\w+)\.weight", k)
        if not proj or proj.group(1) not in rows:
            continue
        block, dr = rows[proj.group(1)]
        at = np.concatenate([np.arange(0, dr, 2), np.arange(1, dr, 2)])  # HF's row of our rotary row j
        order = np.concatenate([np.arange(block - dr), block - dr + (np.argsort(at) if to_hf else at)])
        out[k] = x.reshape(-1, block, x.shape[-1])[:, order].reshape(x.shape)
    return out


def _deepseek_v3_layouts(tensors: dict[str, np.ndarray], m: config.Model) -> dict[str, np.ndarray]:
    """A DeepSeek-V3 checkpoint as its table: the multi-token-prediction layers it holds beyond
    ``model.mtp_num_layers`` (``model.layers.{L}`` and on, ``num_nextn_predict_layers``) dropped, as transformers
    drops them all; the experts per expert (:func:`~jaxllm.families.mixtral.fused_experts`), the rotary rows
    half-split (:func:`_interleave`)."""
    last = m.num_layers + m.mtp_num_layers
    kept = {k: x for k, x in tensors.items()
            if not (i := re.match(r"(?:model\.)?layers\.(\d+)\.", k)) or int(i.group(1)) < last}
    return _interleave(mixtral.fused_experts("mlp", "gate_proj", "up_proj", "down_proj")(kept, m), m, to_hf=False)


def _deepseek_v3_keys(hf: dict, keys: dict) -> dict:
    """DeepSeek-V3's routing and layer kinds as model keys (transformers' ``DeepseekV3TopkRouter``,
    ``DeepseekV3DecoderLayer``): the first ``first_k_dense_replace`` layers dense, the rest mixtures of experts
    (``model.moe_layer_freq``); ``n_shared_experts`` shared experts of ``moe_intermediate_size`` as one shared MLP
    (``model.moe_shared_expert_intermediate_size``); ``n_group`` > 1 groups as ``model.moe_router_num_groups``,
    ``moe_router_group_topk`` (1: no groups).  Raises ConvertError for what jaxllm's router
    (:func:`jaxllm.model.moe.route`) computes otherwise, or MLA with ``num_key_value_heads`` other than the heads:
    ``norm_topk_prob`` other than ``num_experts_per_tok > 1``
    (jaxllm renormalizes exactly the top k of more than one), no shared expert, or groups scored other than
    by their top 2 (transformers sums each group's 2 best scores, jaxllm its ``topk / group_topk``).  Its
    ``num_nextn_predict_layers`` (transformers' default 1) multi-token prediction modules are
    ``model.mtp_num_layers`` (as many as the checkpoint holds: :func:`jaxllm.formats.hf.model_from_hf`)."""
    layers, topk, heads = keys["num_layers"], keys["moe_router_topk"], keys["num_attention_heads"]
    dense, shared = hf.get("first_k_dense_replace", 3), hf.get("n_shared_experts", 1)
    groups, group_topk = hf.get("n_group", 8) or 1, hf.get("topk_group", 4) or 1

    if hf.get("num_key_value_heads") not in (None, heads):  # transformers would repeat MLA's per-head keys
        refuse("num_key_value_heads", hf["num_key_value_heads"], f"num_attention_heads={heads} (or null)")
    if hf.get("norm_topk_prob", True) != (topk > 1):
        refuse("norm_topk_prob", hf.get("norm_topk_prob", True), f"{topk > 1} with num_experts_per_tok={topk} "
               "(jaxllm's sigmoid router renormalizes the top k when k > 1, and only then)")
    if not isinstance(shared, int) or shared < 1:
        refuse("n_shared_experts", shared, "an integer >= 1")
    if not isinstance(dense, int) or not 0 <= dense < layers:
        refuse("first_k_dense_replace", dense, f"an integer from 0 to num_hidden_layers - 1 = {layers - 1}")
    if groups > 1 and topk != 2 * group_topk:
        refuse("topk_group", group_topk, f"num_experts_per_tok / 2 = {topk / 2} with n_group={groups} (transformers "
               "scores a group by its 2 best experts, jaxllm by its num_experts_per_tok / topk_group best)")
    kinds = "1" if not dense else "[" + ",".join("0" if i < dense else "1" for i in range(layers)) + "]"
    mtp = hf.get("num_nextn_predict_layers", 1)  # transformers' default
    if not isinstance(mtp, int) or mtp < 0:
        refuse("num_nextn_predict_layers", mtp, "an integer >= 0")
    return {"kv_channels": 0, "num_kv_heads": heads, "moe_layer_freq": kinds, "mtp_num_layers": mtp,
            "moe_shared_expert_intermediate_size": shared * keys["moe_ffn_hidden_size"],
            "moe_router_num_groups": groups if groups > 1 else 0,
            "moe_router_group_topk": group_topk if groups > 1 else 0}


def _deepseek_v3_misfits(m: config.Model) -> dict[str, Any]:
    """What keeps the model ``m`` from DeepSeek-V3's table beyond its ``needs`` (the refusals of
    :func:`_deepseek_v3_keys`, the other way): model key -> what it needs."""
    bad = mixtral.needs_experts(m)
    shared, f = m.moe_shared_expert_intermediate_size, m.moe_ffn_hidden_size
    if not shared or not f or shared % f:
        bad["model.moe_shared_expert_intermediate_size"] = Condition(f"a multiple > 0 of moe_ffn_hidden_size={f}")
    kinds = m.moe_layers
    if not kinds[-1] or sorted(kinds) != list(kinds):
        bad["model.moe_layer_freq"] = Condition("dense layers first, then mixtures of experts")
    if m.moe_router_num_groups and m.moe_router_topk != 2 * m.moe_router_group_topk:
        bad["model.moe_router_group_topk"] = Condition(f"model.moe_router_topk / 2 = {m.moe_router_topk / 2}")
    return bad


# YaRN's rope_parameters (transformers' names, DeepSeek-V3's config.json's) -> model keys
_YARN = {"factor": "yarn_rotary_scaling_factor", "original_max_position_embeddings":
         "yarn_original_max_position_embeddings", "beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow",
         "mscale": "yarn_mscale", "mscale_all_dim": "yarn_mscale_all_dim",
         "truncate": "yarn_correction_range_round_to_int"}


def _read_yarn(rope: dict, refuse) -> dict:
    """Model keys of rope type ``yarn``'s parameters (transformers' ``_compute_yarn_parameters``): ``factor`` and
    ``original_max_position_embeddings`` needed; ``beta_fast``, ``beta_slow`` 32 and 1 when absent, ``truncate``
    true.  transformers scales rotary by ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` only when both
    are given, else by ``mscale(factor, 1)``, and the scores (DeepSeek-V3's attention) by ``mscale(factor,
    mscale_all_dim)^2``: the keys are chosen to give the same (:mod:`jaxllm.model.rotary`).  An
    ``attention_factor`` other than that is refused."""
    missing = [k for k in ("factor", "original_max_position_embeddings") if rope.get(k) is None]
    if missing:
        refuse("rope_parameters", rope, f"the yarn rope type's {', '.join(missing)} too")
    f, ms, all_dim = float(rope["factor"]), rope.get("mscale"), float(rope.get("mscale_all_dim") or 0)
    if not (ms and all_dim):  # rotary times mscale(f, 1): jaxllm's mscale(f, ms) / mscale(f, all_dim) with this ms
        ms = 1.0 if f <= 1 or not all_dim else (rotary.mscale(f, 1) * rotary.mscale(f, all_dim) - 1) / (0.1 * np.log(f))
    keys = {"rope_type": "yarn", "yarn_rotary_scaling_factor": f, "yarn_mscale": float(ms),
            "yarn_mscale_all_dim": all_dim,
            "yarn_original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
            "yarn_beta_fast": float(rope.get("beta_fast") or 32), "yarn_beta_slow": float(rope.get("beta_slow") or 1),
            "yarn_correction_range_round_to_int": bool(rope.get("truncate", True))}
    given, computed = rope.get("attention_factor"), rotary.mscale(f, ms) / rotary.mscale(f, all_dim)
    if given is not None and abs(given - computed) > 1e-6 * computed:
        refuse("rope_parameters.attention_factor", given, f"{computed} (YaRN's, from factor, mscale, mscale_all_dim)")
    return keys


YARN_ROPE = RopeType(
    what="YaRN", read=_read_yarn, applies=lambda m: m.rope_type == "yarn",
    write=lambda m: {"rope_type": "yarn", **{hf: getattr(m, ours) for hf, ours in _YARN.items()}})

# DeepSeek-V3 (and Moonlight, DeepSeek-V3-architecture): multi-head latent attention; the first
# first_k_dense_replace layers a dense MLP, the rest a mixture of experts with sigmoid routing (its expert bias,
# e_score_correction_bias, choosing the top k; groups; the top k renormalized and scaled) and shared experts; YaRN
# (rope type yarn); multi-token prediction modules (model.layers.{num_hidden_layers + k}: each its enorm, hnorm,
# eh_proj, a layer of the last layer's kind, shared_head.norm, and copies of the embedding and output layer, as
# DeepSeek-V3's checkpoint holds them); the defaults are transformers' DeepseekV3Config's
DEEPSEEK_V3 = Arch(
    model_type="deepseek_v3", hf_class="DeepseekV3ForCausalLM",
    # and num_experts > 0, shared experts, dense layers first (misfits)
    needs={"position_embedding": "rotary", "norm": "rmsnorm", "activation": "swiglu", "use_bias": False,
           "add_qkv_bias": False, "qk_layernorm": False, "sliding_window": 0, "multi_latent_attention": True,
           "moe_capacity_factor": 0.0, "moe_router_score_function": "sigmoid", "moe_router_pre_softmax": False,
           "moe_router_enable_expert_bias": True},
    keys={"num_hidden_layers": ("num_layers", 61), "hidden_size": ("hidden_size", 7168),
          "num_attention_heads": ("num_attention_heads", 128), "intermediate_size": ("ffn_hidden_size", 18432),
          "moe_intermediate_size": ("moe_ffn_hidden_size", 2048),
          "n_routed_experts": ("num_experts", 256), "num_experts_per_tok": ("moe_router_topk", 8),
          "routed_scaling_factor": ("moe_router_topk_scaling_factor", 2.5), "q_lora_rank": ("q_lora_rank", 1536),
          "kv_lora_rank": ("kv_lora_rank", 512), "qk_nope_head_dim": ("qk_head_dim", 128),
          "qk_rope_head_dim": ("qk_pos_emb_head_dim", 64), "v_head_dim": ("v_head_dim", 128),
          "vocab_size": ("vocab_size", 129280), "max_position_embeddings": ("max_position_embeddings", 4096),
          "rms_norm_eps": ("norm_eps", 1e-6), "rope_theta": ("rotary_base", 10000.0),
          "initializer_range": ("init_std", 0.02), "tie_word_embeddings": ("tie_embeddings", False)},
    aliases={"num_local_experts": "n_routed_experts"},  # transformers' attribute_map
    # scoring_func, topk_method: DeepSeek's own config.json's names of the router transformers implements
    supports={"hidden_act": ("silu",), "attention_bias": (False,), "rope_interleave": (True,),
              "scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",)},
    extra=lambda m: {"num_key_value_heads": m.num_attention_heads, "attention_dropout": 0.0,
                     "n_shared_experts": m.moe_shared_expert_intermediate_size // m.moe_ffn_hidden_size,
                     "first_k_dense_replace": m.moe_layers.index(True),
                     "n_group": m.moe_router_num_groups or 1, "topk_group": m.moe_router_group_topk or 1,
                     "norm_topk_prob": m.moe_router_topk > 1, "routed_scaling_factor": m.moe_router_topk_scaling_factor
                     or 1.0, "q_lora_rank": m.q_lora_rank or None, "num_nextn_predict_layers": m.mtp_num_layers,
                     "output_router_logits": False, **llama.rope_parameters(m, YARN_ROPE)},
    **llama.FILES,
    tensors=(
        llama.ATTENTION[0], llama.ATTENTION[1],  # embeddings, input_layernorm
        *(Tensor(f"model.layers.{{i}}.self_attn.{hf}.weight", (f"layers/attn/{ours}",), linear=True)
          for hf, ours in (("q_proj", "wq"), ("q_a_proj", "wq_a"), ("q_b_proj", "wq_b"),  # [n*(dn+dr), h or rq]
                           ("kv_a_proj_with_mqa", "wkv_a"), ("kv_b_proj", "wkv_b"))),  # [rkv+dr, h], [n*(dn+dv), rkv]
        Tensor("model.layers.{i}.self_attn.q_a_layernorm.weight", ("layers/attn/q_a_norm/scale",), VEC),
        Tensor("model.layers.{i}.self_attn.kv_a_layernorm.weight", ("layers/attn/kv_a_norm/scale",), VEC),
        Tensor("model.layers.{i}.self_attn.o_proj.weight", ("layers/attn/wo",), 2, linear=True),  # [h, n*dv]
        llama.ATTENTION[-1],  # post_attention_layernorm
        *llama.MLP, *mixtral.expert_rows("mlp", "gate_proj", "up_proj", "down_proj"),
        Tensor("model.layers.{i}.mlp.gate.e_score_correction_bias", ("layers/mlp/expert_bias",), VEC, moe=True),
        *(Tensor(f"model.layers.{{i}}.mlp.shared_experts.{hf}.weight", (f"layers/mlp/shared/{ours}",), linear=True,
                 moe=True) for hf, ours in (("gate_proj", "wg"), ("up_proj", "w1"), ("down_proj", "w2"))),
        *llama.OUTPUT),
    mtp=(Tensor("model.layers.{m}.eh_proj.weight", ("mtp/eh_proj",), 2, linear=True),  # [h, 2h]: [e; h] in
         Tensor("model.layers.{m}.enorm.weight", ("mtp/enorm/scale",), VEC),
         Tensor("model.layers.{m}.hnorm.weight", ("mtp/hnorm/scale",), VEC),
         Tensor("model.layers.{m}.shared_head.norm.weight", ("mtp/norm/scale",), VEC),
         Tensor("model.layers.{m}.embed_tokens.weight", ("wte",)),  # copies of the shared embedding and head
         Tensor("model.layers.{m}.shared_head.head.weight", ("lm_head",), linear=True)),
    free=("rope_type",),
    layouts=_deepseek_v3_layouts,
    saves=lambda tensors, m: _interleave(tensors, m, to_hf=True),
    derive=_deepseek_v3_keys,
    misfits=_deepseek_v3_misfits,
    likely=lambda m: m.multi_latent_attention)


FAMILY = Family(
    name="deepseek_v3", preset=PRESET,
    architectures=(DEEPSEEK_V3,), rope_types={"yarn": YARN_ROPE},
    megatron_args={
        "multi_latent_attention": ((False, None), "multi-head latent attention is not read from Megatron checkpoints"),
        "moe_shared_expert_intermediate_size": ((None, 0), "shared experts are not read from Megatron checkpoints"),
        "moe_router_score_function": (("softmax", None), "jaxllm reads softmax routers from Megatron checkpoints"),
        "moe_router_topk_scaling_factor": ((None,), "jaxllm reads routers without a scaling factor"),
        "moe_router_enable_expert_bias": ((False, None), "the router's expert bias is not read")},
    megatron_keys={"multi_latent_attention": False, "moe_shared_expert_intermediate_size": 0,
                   "moe_router_score_function": "softmax", "rope_type": "rope"},
    sizes={
        # deepseek-ai/DeepSeek-V3 config.json, as recalled (no network here): 61 layers, the first 3 dense (FFN
        # 18432), then 256 experts of 2048, top 8 of 8 groups' best 4 by sigmoid score with the expert bias, scaled by
        # 2.5, 1 shared expert; MLA (q_lora_rank 1536, kv_lora_rank 512, 128 + 64 query/key dimensions, values 128);
        # YaRN (factor 40 over 4096 positions, beta 32 and 1, mscale and mscale_all_dim 1) to 163840 positions; one
        # multi-token prediction module (num_nextn_predict_layers 1).  671.0B parameters without that module,
        # 682.6B with it (685B in the checkpoint, whose module holds its own copies of the embedding and head).  Its
        # published weights are FP8 with block scales (quantization_config), which jaxllm does not read: a bfloat16
        # copy of them (DeepSeek's inference/fp8_cast_bf16.py) imports.
        "DeepSeek-V3": llama.shape(
            61, 7168, 128, 128, 18432, 129280, 163840, 10000.0, multi_latent_attention=True, q_lora_rank=1536,
            kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, num_experts=256,
            moe_router_topk=8, moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048,
            moe_layer_freq="[" + ",".join(["0"] * 3 + ["1"] * 58) + "]", moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5, moe_router_num_groups=8,
            moe_router_group_topk=4, norm_eps=1e-6,
            rope_type="yarn", yarn_rotary_scaling_factor=40.0, yarn_original_max_position_embeddings=4096,
            yarn_beta_fast=32.0, yarn_beta_slow=1.0, yarn_mscale=1.0, yarn_mscale_all_dim=1.0, mtp_num_layers=1),
        # moonshotai/Moonlight-16B-A3B (DeepseekV3ForCausalLM), its config.json values as recalled, not read here (no
        # network): no query latent (q_lora_rank null); layer 0 dense (first_k_dense_replace 1), then 64 experts of
        # 1408, top 6, scaled by 2.446, one group, 2 shared experts; 15.96B parameters, 2.91B active per token.  Its
        # tokenizer (tiktoken-based) is not one jaxllm reads.
        "Moonlight-16B-A3B": llama.shape(
            27, 2048, 16, 16, 11264, 163840, 8192, 50000.0, multi_latent_attention=True, q_lora_rank=0,
            kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, num_experts=64,
            moe_router_topk=6, moe_ffn_hidden_size=1408, moe_shared_expert_intermediate_size=2 * 1408,
            moe_layer_freq="[" + ",".join(["0"] + ["1"] * 26) + "]", moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.446)})
