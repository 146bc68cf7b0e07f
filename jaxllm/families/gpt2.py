"""GPT-2 (Radford et al. 2019; transformers' ``GPT2LMHeadModel``): learned positions, LayerNorm, GELU's tanh
approximation, biases everywhere and multi-head attention whose heads are ``hidden_size / heads`` wide.  jaxllm's
default model is this layer; ``configs/gpt3.py``'s sizes (Megatron-DeepSpeed's ``MODEL_SIZE_KEY`` shapes) are
trained on it, so the family holds no sizes of its own."""

from jaxllm.data.tokenizers import GPT2_VOCAB_SIZE
from jaxllm.families.tables import VEC, Arch, Family, Tensor

PRESET = {"position_embedding": "learned", "norm": "layernorm", "activation": "gelu", "use_bias": True}

GPT2 = Arch(
    model_type="gpt2", hf_class="GPT2LMHeadModel",
    needs={**PRESET, "num_experts": 0, "qk_layernorm": False, "sliding_window": 0, "kv_channels": 0,
           "multi_latent_attention": False},
    keys={"n_layer": ("num_layers", 12), "n_embd": ("hidden_size", 768), "n_head": ("num_attention_heads", 12),
          "n_inner": ("ffn_hidden_size", None), "vocab_size": ("vocab_size", GPT2_VOCAB_SIZE),
          "n_positions": ("max_position_embeddings", 1024), "layer_norm_epsilon": ("norm_eps", 1e-5),
          "resid_pdrop": ("dropout", 0.1), "initializer_range": ("init_std", 0.02),
          "tie_word_embeddings": ("tie_embeddings", True)},
    supports={"activation_function": ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"),  # GELU's tanh approximation
              "scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,),
              "add_cross_attention": (False,)},
    extra=lambda m: {"embd_pdrop": m.dropout, "attn_pdrop": 0.0, "reorder_and_upcast_attn": False},
    prefix="transformer.",
    buffers=r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias",  # causal-mask buffers of old versions
    tensors=(
        Tensor("transformer.wte.weight", ("wte",)),  # [vocab, h]
        Tensor("transformer.wpe.weight", ("wpe",)),  # [positions, h]
        Tensor("transformer.h.{i}.ln_1.weight", ("layers/ln1/scale",), VEC),
        Tensor("transformer.h.{i}.ln_1.bias", ("layers/ln1/bias",), VEC),
        Tensor("transformer.h.{i}.attn.c_attn.weight", ("layers/attn/wq", "layers/attn/wk", "layers/attn/wv")),
        Tensor("transformer.h.{i}.attn.c_attn.bias", ("layers/attn/bq", "layers/attn/bk", "layers/attn/bv"), VEC),
        Tensor("transformer.h.{i}.attn.c_proj.weight", ("layers/attn/wo",), 2),  # [h, h]
        Tensor("transformer.h.{i}.attn.c_proj.bias", ("layers/attn/bo",), VEC),
        Tensor("transformer.h.{i}.ln_2.weight", ("layers/ln2/scale",), VEC),
        Tensor("transformer.h.{i}.ln_2.bias", ("layers/ln2/bias",), VEC),
        Tensor("transformer.h.{i}.mlp.c_fc.weight", ("layers/mlp/w1",)),  # [h, f]
        Tensor("transformer.h.{i}.mlp.c_fc.bias", ("layers/mlp/b1",), VEC),
        Tensor("transformer.h.{i}.mlp.c_proj.weight", ("layers/mlp/w2",)),  # [f, h]
        Tensor("transformer.h.{i}.mlp.c_proj.bias", ("layers/mlp/b2",), VEC),
        Tensor("transformer.ln_f.weight", ("ln_f/scale",), VEC),
        Tensor("transformer.ln_f.bias", ("ln_f/bias",), VEC),
        Tensor("lm_head.weight", ("lm_head",), linear=True),  # [vocab, h]
    ),
    # multi-head attention only: every head its own key and value
    misfits=lambda m: ({"model.num_kv_heads": m.num_attention_heads} if m.num_kv_heads != m.num_attention_heads
                       else {}),
    likely=lambda m: True)  # what any other model is closest to by default

FAMILY = Family(name="gpt2", preset=PRESET, architectures=(GPT2,))
