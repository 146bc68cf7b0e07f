"""Llama-style recipes: ALCF Megatron-DeepSpeed's train_llama_alcf.sh, in jaxllm keys, for Llama's, Qwen's
(dense and mixture of experts), Mistral's, DeepSeek-V3's (and Moonlight's), OLMo 2's, Gemma 3's and gpt-oss's
shapes.

    python -m jaxllm.train --config=configs/llama.py:Llama-3-8B --config.data.tokenizer=PATH/tokenizer.json ...
    LLAMA=1 MODEL_SIZE_KEY=AuroraGPT-2B TOKENIZER_TYPE=PATH/tokenizer.json sbatch launch/frontier.sbatch

The training recipe is the one argonne-lcf/Megatron-DeepSpeed's train_llama_alcf.sh runs with
no knobs set: its ALCF/helpers.sh (get_training_args, setParams) passes --swiglu, --normalization
rmsnorm, --disable-bias-linear, --use-rotary-position-embeddings, --untie-embeddings-and-output-weights,
--num-key-value-heads, --hidden-dropout 0, --attention-dropout 0, and --lr 0.0002,
--lr-decay-style cosine, --lr-warmup-fraction 0.05, --optimizer adamw, --adam-beta1 0.9,
--adam-beta2 0.95, --adam-eps 0.00001, --weight-decay 0.1, --clip-grad 1.0, --split 990,10,0,
--eval-interval 100, --eval-iters 20, --save-interval 50; no --min-lr (Megatron's default: 0).

Keys (model shapes, each from the file named):
  ALCF-7B       ALCF/helpers.sh's setParams defaults ("Llama2 7B Config" but with NUM_KV_HEAD=8):
                32 layers, hidden 4096, 32 heads, 8 KV heads, FFN 11008, SEQ 2048.
  AuroraGPT-2B  argonne-lcf/Megatron-DeepSpeed ALCF/AuroraGPT/2B/MODEL_CARD.md: 12 layers, hidden
                2048, 16 heads, 4 KV heads, FFN 11008, sequence 8192, vocabulary 256000 (google/gemma-7b's
                tokenizer), ~1.986B parameters.  The card gives no rotary base: jaxllm's default 10000
                is kept (not checked against the run's).  It was trained with SophiaG, which jaxllm does
                not have; the card's betas, weight decay, warmup fraction and clipping are this recipe's.
  Llama-2-7B    32 layers, hidden 4096, 32 heads: ALCF/helpers.sh's "Llama2 7B Config" block; no GQA and
                context 4k: meta-llama/llama MODEL_CARD.md; FFN 11008 = multiple_of 256 over 2/3 x 4 x 4096,
                norm_eps 1e-5, rotary theta 10000: meta-llama/llama llama/model.py (FeedForward, ModelArgs,
                precompute_freqs_cis); vocabulary 32000: the Llama 2 paper (Touvron et al. 2023, section 2.2,
                "The total vocabulary size is 32k tokens").  6.74B parameters.
  Llama-3-8B    meta-llama/llama3 Meta-Llama-3-8B-Instruct/params.json (dim 4096, 32 layers, 32 heads,
                8 KV heads, vocabulary 128256, ffn_dim_multiplier 1.3 and multiple_of 1024 -> FFN 14336,
                norm_eps 1e-5, rope_theta 500000) and MODEL_CARD.md (context 8k).  8.03B parameters.
  Llama-3.1-8B  meta-llama/Llama-3.1-8B config.json: Llama-3-8B's shape with 131072 positions and Llama 3.1's
                rotary scaling (rope_type llama3: factor 8, low_freq_factor 1, high_freq_factor 4,
                original_max_position_embeddings 8192; model.use_rope_scaling); trained here at 8192 tokens.
  Qwen2.5-7B    Qwen/Qwen2.5-7B config.json (Qwen2ForCausalLM): 28 layers, hidden 3584, 28 heads, 4 KV heads,
                FFN 18944, vocabulary 152064, 131072 positions, rope_theta 1e6, rms_norm_eps 1e-6, biases on
                the query/key/value projections (model.add_qkv_bias).  7.62B parameters.
  Qwen3-8B      Qwen/Qwen3-8B config.json (Qwen3ForCausalLM): 36 layers, hidden 4096, 32 heads (head_dim 128),
                8 KV heads, FFN 12288, vocabulary 151936, 40960 positions, rope_theta 1e6, rms_norm_eps 1e-6,
                RMSNorm of each head's queries and keys (model.qk_layernorm).  8.19B parameters.
  Qwen3-30B-A3B Qwen/Qwen3-30B-A3B config.json (Qwen3MoeForCausalLM): Qwen3's attention with 48 layers, hidden
                2048, 32 heads of 128 (model.kv_channels: 4096 wide, not hidden / heads), 4 KV heads; in every layer
                a mixture of 128 experts of FFN 768, top 8 renormalized (norm_topk_prob true), no shared expert
                (router_aux_loss_coef 0.001 as model.moe_aux_loss_coeff; intermediate_size 6144, the FFN of dense
                layers, which mlp_only_layers [] leaves none of); vocabulary 151936, 40960 positions, rope_theta 1e6,
                rms_norm_eps 1e-6.  30.53B parameters, 3.35B of them active per token.
                The Qwen keys are trained here at 8192 tokens; their tokenizers are Qwen's tokenizer.json.
  Moonlight-16B-A3B  moonshotai/Moonlight-16B-A3B (DeepseekV3ForCausalLM), its config.json values as recalled, not
                read here (no network): 27 layers, hidden 2048, 16 heads of multi-head latent attention
                (model.multi_latent_attention; no query latent, q_lora_rank null; kv_lora_rank 512,
                qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128); layer 0 a dense MLP of FFN 11264
                (first_k_dense_replace 1), the others 64 experts of FFN 1408, top 6 by sigmoid score plus the
                expert bias (e_score_correction_bias), renormalized and scaled by 2.446 (routed_scaling_factor), one
                group (n_group 1: no group-limited routing), 2 shared experts (one shared MLP of 2816); vocabulary
                163840, 8192 positions, rope_theta 50000, rms_norm_eps 1e-5.  15.96B parameters (as transformers'
                DeepseekV3Config builds for these values, its expert biases counted), 2.91B of them active per
                token (the embeddings included).  Its tokenizer (tiktoken-based, tokenization_moonshot.py) is
                not one jaxllm reads.
  DeepSeek-V3   deepseek-ai/DeepSeek-V3 (DeepseekV3ForCausalLM; jaxllm/families/deepseek_v3.py has its shape and
                source): Moonlight's architecture at 61 layers, hidden 7168, 128 heads with a query latent of 1536,
                256 experts of 2048 (top 8 in 4 of 8 groups, scaled by 2.5) after 3 dense layers, YaRN rotary
                scaling (model.rope_type=yarn, factor 40) and one multi-token prediction module
                (model.mtp_num_layers=1); trained here at 4096 tokens.  671.0B parameters (682.6B with the module).
  OLMo-2-1B, OLMo-2-7B, OLMo-2-13B, OLMo-2-32B  allenai's OLMo 2 (Olmo2ForCausalLM; jaxllm/families/olmo2.py has
                their shapes and sources): Llama's layer with its norms after attention and the MLP
                (model.norm_placement=post) and query/key norms over all heads (model.qk_layernorm_per_head=False);
                vocabulary 100352, 4096 positions (trained here at 4096 tokens), rope_theta 500000, rms_norm_eps 1e-6.
  Gemma-3-1B, Gemma-3-4B, Gemma-3-12B, Gemma-3-27B  Google's Gemma 3 text models (Gemma3ForCausalLM;
                jaxllm/families/gemma3.py has their shapes and sources): (1 + w) RMSNorms before and after attention
                and the MLP, GeGLU, embeddings times sqrt(hidden), query/key norms, five local layers (a window of 512
                in 1B, 1024 in the others, rotary base 10000) per global one (rotary base 1e6, linearly scaled by 8 in
                4B and up), tied embeddings; vocabulary 262144 (1B) or 262208.
  gpt-oss-20b, gpt-oss-120b  OpenAI's gpt-oss (GptOssForCausalLM; jaxllm/families/gpt_oss.py has their shapes and
                sources): 24 or 36 layers of hidden 2880, 64 heads of 64 with attention sinks (model.softmax_type=
                learnable), windows of 128 on every other layer, YaRN (factor 32 over 4096 positions), 32 or 128
                experts (top 4, router bias) of a clamped SwiGLU (model.activation=quick_geglu); vocabulary 201088;
                trained here at 4096 tokens.  20.9B and 116.8B parameters, 4.19B and 5.71B active per token (the
                model card's 3.61B and 5.13B leave out the embedding table).
  Mistral-7B    mistralai/Mistral-7B-v0.1 config.json (MistralForCausalLM): 32 layers, hidden 4096, 32 heads,
                8 KV heads, FFN 14336, vocabulary 32000, 32768 positions, rope_theta 10000, rms_norm_eps 1e-5,
                each token attending to the last 4096 positions (model.sliding_window).  7.24B parameters.
  tiny          a 2-layer model of the same recipe for CPUs, tests and demos (byte tokenizer).

The tokenizer: the published keys name none that jaxllm reads for them (data.tokenizer is left
empty, so a run says to set it): give a Hugging Face tokenizer.json with --config.data.tokenizer=PATH
(or TOKENIZER_TYPE=PATH with the launch scripts); its vocabulary must fit model.vocab_size.
"""

from jaxllm.config import get_config as defaults
from jaxllm.families import llama, registry

# the shapes this recipe trains (jaxllm.families: each family's module holds its sizes, with their sources)
SIZES = ("ALCF-7B", "AuroraGPT-2B", "Llama-2-7B", "Llama-3-8B", "Llama-3.1-8B", "Qwen2.5-7B", "Qwen3-8B", "Mistral-7B",
         "Qwen3-30B-A3B", "Moonlight-16B-A3B", "DeepSeek-V3", "OLMo-2-1B", "OLMo-2-7B", "OLMo-2-13B", "OLMo-2-32B",
         "Gemma-3-1B", "Gemma-3-4B", "Gemma-3-12B", "Gemma-3-27B", "gpt-oss-20b", "gpt-oss-120b")
# train.seq_length (OLMo 2's: its 4096 positions; DeepSeek-V3's and gpt-oss's length before YaRN); the others 8192
SEQ_LENGTH = {"ALCF-7B": 2048, "Llama-2-7B": 4096, "DeepSeek-V3": 4096, "gpt-oss-20b": 4096, "gpt-oss-120b": 4096,
              **{f"OLMo-2-{n}": 4096 for n in ("1B", "7B", "13B", "32B")}}
KEYS = (*SIZES, "tiny")


def recipe(c):
    """train_llama_alcf.sh's architecture and training flags (see the module docstring) on config ``c``."""
    c.model.update(**llama.PRESET, norm_eps=1e-5, tie_embeddings=False, dropout=0.0)
    c.train.update(optimizer="adamw", lr=2e-4, min_lr=0.0, lr_decay_style="cosine", warmup_iters=0,
                   lr_warmup_fraction=0.05, beta1=0.9, beta2=0.95, adam_eps=1e-5, weight_decay=0.1, grad_clip=1.0,
                   eval_interval=100, eval_iters=20)
    c.checkpoint.interval = 50
    c.data.split = "990,10,0"
    return c


def get_config(key="ALCF-7B"):
    if key not in KEYS:
        raise ValueError(f"configs/llama.py:{key}: unknown key; choose one of {', '.join(KEYS)}")
    c = recipe(defaults())
    if key == "tiny":
        c.model.update(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                       make_vocab_size_divisible_by=1)
        c.train.update(seq_length=64, micro_batch_size=4, global_batch_size=8, train_iters=20, eval_interval=10,
                       eval_iters=2, log_interval=5)
        c.data.tokenizer = "byte"
        return c
    c.model.update(**registry.SIZES[key], dtype="bfloat16")
    c.train.update(seq_length=SEQ_LENGTH.get(key, 8192), micro_batch_size=1, global_batch_size=8, train_iters=1000)
    c.data.tokenizer = ""  # a Hugging Face tokenizer.json whose vocabulary fits model.vocab_size (see above)
    return c
