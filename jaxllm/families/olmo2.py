"""OLMo 2 (Walsh et al. 2025, "2 OLMo 2 Furious", arXiv:2501.00656; transformers' ``Olmo2ForCausalLM``): Llama's
layer with its norms moved after attention and the MLP, on their outputs before the residual sum (the "reordered
norm" of section 3.2: ``x + norm(attn(x))``, ``model.norm_placement="post"``; no norm before either), and an RMSNorm
of the queries and one of the keys over the whole projection, all heads together (``model.qk_layernorm`` with
``model.qk_layernorm_per_head=False``), before rotary.

Sizes: AI2's 1B, 7B, 13B and 32B; ``configs/llama.py`` trains them on ALCF's recipe.
"""

from jaxllm.families import llama
from jaxllm.families.tables import VEC, Arch, Family, Tensor

PRESET = {**llama.PRESET, "norm_placement": "post", "qk_layernorm": True, "qk_layernorm_per_head": False}

# the norms of model.norm_placement post (and sandwich): after attention, after the MLP
POST_NORMS = (Tensor("model.layers.{i}.post_attention_layernorm.weight", ("layers/post_attn_norm/scale",), VEC),
              Tensor("model.layers.{i}.post_feedforward_layernorm.weight", ("layers/post_mlp_norm/scale",), VEC))

OLMO2 = Arch(
    model_type="olmo2", hf_class="Olmo2ForCausalLM",
    needs={**llama.NEEDS, **PRESET},
    # transformers' Olmo2Config defaults
    keys={**llama.KEYS, "vocab_size": ("vocab_size", 50304), "rms_norm_eps": ("norm_eps", 1e-5)},
    supports={"hidden_act": ("silu",), "attention_bias": (False,)},
    extra=lambda m: {"head_dim": m.head_dim, "attention_dropout": 0.0, **llama.rope_parameters(m)},
    **llama.FILES,
    tensors=(
        llama.ATTENTION[0],  # the embedding, then each layer's projections
        *llama.PROJECTIONS,
        *llama.QK_NORMS,  # one norm of all heads' queries [heads*d], one of all heads' keys [kv_heads*d]
        *POST_NORMS,
        *llama.MLP, *llama.OUTPUT),
    likely=lambda m: m.norm_placement == "post")

# The sizes, each from the Hugging Face config.json of allenai's model named, as recalled (no network here): the
# vocabulary of OLMo 2's tokenizer (cl100k-based, 100278 tokens) padded to 100352 rows; rope theta 500000; the
# 1B's rms_norm_eps 1e-6 as the others'; the padding token <|pad|> id 100277 (model.pad_token_id)
SIZES = {
    # allenai/OLMo-2-0425-1B
    "OLMo-2-1B": llama.shape(16, 2048, 16, 16, 8192, 100352, 4096, 500000.0, norm_eps=1e-6, pad_token_id=100277,
                              **PRESET),
    # allenai/OLMo-2-1124-7B
    "OLMo-2-7B": llama.shape(32, 4096, 32, 32, 11008, 100352, 4096, 500000.0, norm_eps=1e-6, pad_token_id=100277,
                              **PRESET),
    # allenai/OLMo-2-1124-13B
    "OLMo-2-13B": llama.shape(40, 5120, 40, 40, 13824, 100352, 4096, 500000.0, norm_eps=1e-6, pad_token_id=100277,
                              **PRESET),
    # allenai/OLMo-2-0325-32B (grouped-query attention: 8 key/value heads)
    "OLMo-2-32B": llama.shape(64, 5120, 40, 8, 27648, 100352, 4096, 500000.0, norm_eps=1e-6, pad_token_id=100277,
                              **PRESET),
}

FAMILY = Family(
    name="olmo2", preset=PRESET, architectures=(OLMO2,),
    # megatron-core's GPTModel has its norms before attention and the MLP, and per-head query/key norms
    megatron_keys={"norm_placement": "pre", "qk_layernorm_per_head": True},
    sizes=SIZES)
