"""Makes the Megatron-DeepSpeed checkpoints of tests/data/deepspeed/ with DeepSpeed's own engine on the CPU.

A small GPT whose modules are named and laid out as Megatron-DeepSpeed's ``GPTModel`` (argonne-lcf's fork:
``megatron/model/{gpt_model,language_model,transformer,rotary_pos_embedding}.py``; fused QKV rows per key/value
group: its queries, key, value), GPT-style (tanh GELU as ``--openai-gelu``, LayerNorm, learned positions, biases,
tied output) or Llama-style (``llama_*`` cases: RMSNorm, SwiGLU with the gate's rows first, rotary embeddings
rotating halves, grouped-query attention, no biases, an untied output layer), or as its ``GPTModelPipe``
(DeepSpeed's ``PipelineModule``: spec 0 casts, 1 embeds, 2..L+1 the layers, L+2 the final norm, then the tied head
or L+3 the untied ``LMHeadPipe``), trains 3 steps
under DeepSpeed and is saved as Megatron-DeepSpeed's ``save_checkpoint`` does (``engine.save_checkpoint`` with
Megatron's ``args``, ``iteration``, ``checkpoint_version``, ``universal_checkpoint_info``, ``rng_state``; Megatron's
``OptimizerParamScheduler`` state as ``lr_scheduler``).  Beside it, ``expected_rankR.npz``: every parameter's
float32 master and Adam moments as the live engine holds them (DeepSpeed's ``safe_get_full_fp32_param``,
``safe_get_full_optimizer_state``), and (not pipelined) the float32 model's logits on a batch.

Made once with DeepSpeed 0.19.8 (not a test dependency; ``pip install deepspeed`` with ``DS_BUILD_OPS=0``)::

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node=2 tests/deepspeed_checkpoint.py CASE OUT
    DS_ACCELERATOR=cpu python -m deepspeed.checkpoint.ds_to_universal --input_folder OUT/global_step3 \\
        --output_folder OUT_universal/global_step3 --num_extract_workers 1 --num_merge_workers 1

CASE: a key of :data:`CASES`.
"""

import argparse
import os
import random
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, PADDED_VOCAB, DIVISIBLE_BY = 60, 63, 3  # Megatron pads to a multiple of --make-vocab-size-divisible-by
LAYERS, SEQ, MICRO, STEPS, THETA = 2, 8, 2, 3, 10000.0
# GPT-style: odd sizes, so that ZeRO's partitions pad; Llama-style: 4 query heads in 2 groups of head size 4
SIZES = {"gpt": (15, 3, 3, 36), "llama": (16, 4, 2, 20)}  # hidden, heads, key/value heads, FFN
HIDDEN, HEADS, KV_HEADS, FFN = SIZES["gpt"]
LLAMA = False
CASES = {  # name: (ZeRO stage, bf16, pipeline stages, Megatron's nested module state, DeepSpeed options)
    "zero1_bf16_nested": (1, True, 0, True, {}),  # argonne's PP=1 runs (--no-pipeline-parallel)
    "zero2_fp32_aligned": (2, False, 0, False, {"parameter_alignment": True, "round_robin_gradients": True}),
    "zero3_bf16": (3, True, 0, True, {}),
    "pipeline2_bf16": (1, True, 2, False, {}),  # argonne's PP>1 runs: BF16_Optimizer (grad_accum_dtype fp32)
    "llama_zero1_bf16_nested": (1, True, 0, True, {}),
    "llama_pipeline2_bf16": (1, True, 2, False, {}),
}


def rotary(x):
    """Rotary embeddings of ``x [s, b, heads, d]`` as Megatron-DeepSpeed's ``apply_rotary_pos_emb``: the halves
    rotated (``_rotate_half``), frequencies ``THETA ** (-2i / d)``."""
    d = x.shape[-1]
    freqs = torch.outer(torch.arange(x.shape[0]).float(), 1.0 / THETA ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * emb.cos().to(x.dtype) + torch.cat([-x2, x1], dim=-1) * emb.sin().to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def norm():
    return RMSNorm(HIDDEN) if LLAMA else nn.LayerNorm(HIDDEN, eps=1e-5)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        d = HIDDEN // HEADS
        self.query_key_value = nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * d, bias=not LLAMA)
        self.dense = nn.Linear(HIDDEN, HIDDEN, bias=not LLAMA)

    def forward(self, x):  # [s, b, h]; rows per key/value group: [queries; key; value] (ParallelAttention)
        s, b, _ = x.shape
        group = HEADS // KV_HEADS
        qkv = self.query_key_value(x).view(s, b, KV_HEADS, group + 2, HIDDEN // HEADS)
        q, k, v = qkv[:, :, :, :group].reshape(s, b, HEADS, -1), qkv[:, :, :, group], qkv[:, :, :, group + 1]
        if LLAMA:
            q, k = rotary(q), rotary(k)
        k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))  # query head j reads group j // group
        out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True)
        return self.dense(out.permute(2, 0, 1, 3).reshape(s, b, HIDDEN))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(HIDDEN, 2 * FFN if LLAMA else FFN, bias=not LLAMA)
        self.dense_4h_to_h = nn.Linear(FFN, HIDDEN, bias=not LLAMA)

    def forward(self, x):
        if LLAMA:  # SwiGLU: torch.chunk's first half is the gate
            gate, up = self.dense_h_to_4h(x).chunk(2, dim=-1)
            return self.dense_4h_to_h(F.silu(gate) * up)
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate="tanh"))


class TransformerLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = norm()
        self.self_attention = Attention()
        self.post_attention_layernorm = norm()
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.self_attention(self.input_layernorm(x))
        return (x + self.mlp(self.post_attention_layernorm(x))).contiguous()


class Embedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(PADDED_VOCAB, HIDDEN)
        if not LLAMA:
            self.position_embeddings = nn.Embedding(SEQ, HIDDEN)

    @property
    def word_embeddings_weight(self):
        return self.word_embeddings.weight

    def forward(self, ids):  # [b, s] -> [s, b, h]
        x = self.word_embeddings(ids)
        if not LLAMA:
            x = x + self.position_embeddings(torch.arange(ids.shape[1]))[None]
        return x.transpose(0, 1).contiguous()


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([TransformerLayer() for _ in range(LAYERS)])
        self.final_layernorm = norm()


class LanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = Embedding()
        self.encoder = Encoder()
        if LLAMA:  # --untie-embeddings-and-output-weights
            self.output_layer = nn.Linear(HIDDEN, PADDED_VOCAB, bias=False)


class GPTModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.language_model = LanguageModel()

    def logits(self, ids):
        x = self.language_model.embedding(ids)
        for layer in self.language_model.encoder.layers:
            x = layer(x)
        head = (self.language_model.output_layer if LLAMA else self.language_model.embedding.word_embeddings).weight
        return self.language_model.encoder.final_layernorm(x).transpose(0, 1) @ head.t()

    def forward(self, ids, labels):
        return F.cross_entropy(self.logits(ids).float().reshape(-1, PADDED_VOCAB), labels.reshape(-1))

    def nested_state_dict(self, destination=None, prefix="", keep_vars=False):  # state_dict_for_save_checkpoint's
        lm = self.language_model
        return {"language_model": {
            "embedding": {n: m.state_dict(keep_vars=keep_vars) for n, m in lm.embedding.named_children()},
            "encoder": lm.encoder.state_dict(keep_vars=keep_vars),
            **({"output_layer": lm.output_layer.state_dict(keep_vars=keep_vars)} if LLAMA else {})}}


class LMHead(nn.Module):  # argonne's LMHeadPipe
    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(HIDDEN, PADDED_VOCAB, bias=False)

    def forward(self, x):
        return self.lm_head(x).transpose(0, 1)


def pipeline(stages):
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: PLC0415

    def head(embedding, x):
        return x.transpose(0, 1) @ embedding.word_embeddings_weight.t()

    if LLAMA:
        first, last = LayerSpec(Embedding), LayerSpec(LMHead)
    else:
        first = TiedLayerSpec("embed", Embedding, tied_weight_attr="word_embeddings_weight")
        last = TiedLayerSpec("embed", Embedding, forward_fn=head, tied_weight_attr="word_embeddings_weight")
    specs = [lambda x: x, first, *[LayerSpec(TransformerLayer) for _ in range(LAYERS)],
             LayerSpec(RMSNorm, HIDDEN) if LLAMA else LayerSpec(nn.LayerNorm, HIDDEN, eps=1e-5), last]
    def loss(logits, labels):
        return F.cross_entropy(logits.float().reshape(-1, PADDED_VOCAB), labels.reshape(-1))

    return PipelineModule(layers=specs, loss_fn=loss, num_stages=stages, partition_method="type:transformer")


class Scheduler:
    """Megatron's OptimizerParamScheduler's state: its num_steps counts samples, a global batch a step (Megatron's
    ``model.step(lr_kwargs={"increment": ...})``)."""

    def __init__(self, batch):
        self.num_steps, self.batch = 0, batch

    def step(self, increment=None):
        self.num_steps += increment or self.batch

    def get_lr(self):
        return [1e-3]

    def state_dict(self):
        return {"max_lr": 1e-3, "min_lr": 1e-4, "lr_warmup_steps": 0, "lr_decay_steps": 20 * MICRO * 2,
                "lr_decay_style": "cosine", "num_steps": self.num_steps, "start_wd": 0.1, "end_wd": 0.1,
                "wd_incr_style": "constant"}


def megatron_args(zero, bf16, stages, world):
    """Megatron-DeepSpeed's saved arguments: argonne's defaults where they matter (``--optimizer adamw``, the fused
    bias GELU, ``model_type``, an enum)."""
    from megatron.core.enums import ModelType  # noqa: PLC0415

    batch = MICRO * (world // max(stages, 1))
    return argparse.Namespace(model_type=ModelType.encoder_or_decoder, optimizer="adamw", ds_fused_adam=False,
                              bias_gelu_fusion=not LLAMA,
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        kv_channels=HIDDEN // HEADS, num_key_value_heads=KV_HEADS, seq_length=SEQ, max_position_embeddings=SEQ,
        padded_vocab_size=PADDED_VOCAB, make_vocab_size_divisible_by=DIVISIBLE_BY, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=max(stages, 1), no_pipeline_parallel=stages == 0, bf16=bf16, fp16=False,
        params_dtype=torch.bfloat16 if bf16 else torch.float32, normalization="rmsnorm" if LLAMA else "layernorm",
        layernorm_epsilon=1e-5, add_position_embedding=not LLAMA, use_rotary_position_embeddings=LLAMA,
        rope_theta=int(THETA), openai_gelu=False, swiglu=LLAMA, add_bias_linear=not LLAMA,
        untie_embeddings_and_output_weights=LLAMA, hidden_dropout=0.0, attention_dropout=0.0,
        micro_batch_size=MICRO, global_batch_size=batch, train_iters=20, lr=1e-3, min_lr=1e-4,
        lr_decay_style="cosine", lr_warmup_iters=0, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
        adam_eps=1e-8, clip_grad=1.0, seed=1234, consumed_train_samples=STEPS * batch,
        iteration=STEPS, deepspeed=True, zero_stage=zero, tokenizer_type="NullTokenizer", vocab_size=VOCAB,
        num_experts=[1], data_path=None, split="969,30,1")


def main(case, out):
    import deepspeed  # noqa: PLC0415
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: PLC0415

    zero, bf16, stages, nested, options = CASES[case]
    global LLAMA, HIDDEN, HEADS, KV_HEADS, FFN  # noqa: PLW0603 - the model classes read them
    LLAMA = case.startswith("llama")
    HIDDEN, HEADS, KV_HEADS, FFN = SIZES["llama" if LLAMA else "gpt"]
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    ds = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "train_batch_size": MICRO * (world // max(stages, 1)), "zero_optimization": {"stage": zero, **options},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                     "weight_decay": 0.1, "torch_adam": True}}}
    if bf16:
        ds["bf16"] = {"enabled": True}
    if stages:
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
    if zero == 3:
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        with deepspeed.zero.Init(config_dict_or_path=ds):
            model = GPTModel()
    else:
        model = pipeline(stages) if stages else GPTModel()
    # Megatron's get_param_groups: no weight decay for biases and norms
    groups = [{"params": [p for p in model.parameters() if p.ndim > 1]},
              {"params": [p for p in model.parameters() if p.ndim == 1], "weight_decay": 0.0}]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds)
    engine.lr_scheduler = engine.client_lr_scheduler = Scheduler(ds["train_batch_size"])
    batches = torch.Generator().manual_seed(42 + rank)
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=batches)
        if stages:
            engine.train_batch(data_iter=iter([(ids[:, :-1], ids[:, 1:])]))
        else:
            engine.backward(engine(ids[:, :-1], ids[:, 1:]))
            engine.step()
    args = megatron_args(zero, bf16, stages, world)
    embed = ("1." if LLAMA else "tied_modules.embed.") if stages else "language_model.embedding."
    universal = {"universal_checkpoint_version": 0.2, "original_vocab_size": VOCAB, "padded_vocab_size": PADDED_VOCAB,
                 "vocabulary_parameter_patterns": [embed + "word_embeddings.weight"] + (
                     [f"{LAYERS + 3}.lm_head.weight" if stages else "language_model.output_layer.weight"]
                     if LLAMA else []),
                 "pipeline_replicated_parameter_patterns": [embed + "word_embeddings.weight",
                                                            embed + "position_embeddings.weight"]
                 if stages and not LLAMA else [],
                 "parameter_with_2_sub_params_cat_dim_0": []}
    client = {"args": args, "checkpoint_version": 3.0, "iteration": STEPS, "universal_checkpoint_info": universal,
              "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                             "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}]}
    if nested:  # Megatron-DeepSpeed's module state with --no-pipeline-parallel
        engine.module.state_dict = engine.module.nested_state_dict
    engine.save_checkpoint(out, client_state=client)
    if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):  # ZeRO-1/2: DeepSpeed 0.19.8 links the optimizer
        engine.optimizer._hp_optimizer_states_linked = False  # state to the parameters after the first group's
        engine.optimizer._lazy_init_hp_params_optimizer_state()  # first step only; again, every group's now
    expected = {}
    for name, p in engine.module.named_parameters():  # collective under ZeRO-3: every rank, in order
        expected[f"fp32/{name}"] = safe_get_full_fp32_param(p).float().numpy()
        for k in ("exp_avg", "exp_avg_sq"):
            expected[f"{k}/{name}"] = safe_get_full_optimizer_state(p, k).float().numpy()
    if not stages and rank == 0:  # the float32 model of the masters: its logits on a batch
        ref = GPTModel()
        ref.load_state_dict({n: torch.from_numpy(expected[f"fp32/{n}"]) for n, _ in ref.named_parameters()})
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            expected.update(ids=ids.numpy(), logits=ref.logits(ids).numpy())
    if stages or rank == 0:  # a pipeline stage's parameters are its own
        np.savez_compressed(os.path.join(out, f"expected_rank{rank}.npz"), **expected)
    torch.distributed.barrier()
    if rank == 0:
        for copied in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's scripts, not read
            os.remove(os.path.join(out, copied))
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:  # Megatron's tracker
            f.write(str(STEPS))


if __name__ == "__main__":
    main(*sys.argv[1:3])
