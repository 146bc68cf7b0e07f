"""Makes a Megatron-LM ``torch_dist`` checkpoint with megatron-core on the CPU, as Megatron-LM's
``training/checkpointing.py`` lays one out (``DIR/latest_checkpointed_iteration.txt``, ``DIR/iter_0000NNN/``
holding ``dist_checkpointing.save``'s files; the saved state: ``args``, ``iteration``, ``checkpoint_version``,
``model``, ``optimizer``, ``opt_param_scheduler``), or reads one back into a model of any layout.

Run by tests/test_megatron_checkpoint.py under ``torch.distributed.run`` (gloo, one process per rank)::

    save KIND DIR ITERS   # tensor 2 x pipeline 2 (moe: pipeline 2 x expert 2, see layout()): ITERS AdamW steps,
                          # then the checkpoint of iteration ITERS
    load KIND DIR OUT     # one process: megatron-core's reading of it (OUT.npz: every tensor, and the logits
                          # of a tensor-1 model loaded from it on a batch)

KIND: ``gpt`` (learned positions, LayerNorm, GELU (tanh), biases, tied output), ``llama`` (rotary, RMSNorm,
SwiGLU, grouped-query attention, no biases, untied output) or ``moe`` (llama with 4 experts, top 2); for ``load``
only, ``shakespeare`` (configs/shakespeare_char.py's model: gpt's without biases, hidden 128, 65 characters,
context 64).
The optimizer is torch's AdamW on each rank's parameters, its state laid out by megatron-core's own
``get_param_id_to_sharded_param_map`` / ``optim_state_to_sharding_state`` (``FP32Optimizer.sharded_state_dict``:
megatron-core's optimizer classes need CUDA); gradients come from each pipeline stage's own part of a loss.
"""

import argparse
import contextlib
import os
import sys

import numpy as np
import torch
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core import parallel_state as ps
from megatron.core.activations import fast_gelu
from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map, optim_state_to_sharding_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.transformer_config import TransformerConfig

# CUDA-only calls of megatron-core on the paths these CPU runs take, each made a no-op or the CPU:
# megatron-core moves the tied embedding to the GPU before it sums the first and last stages' copies
# (LanguageModule.setup_embeddings_and_output_layer): here it stays where it is, on the CPU
torch.Tensor.cuda = lambda self, *args, **kwargs: self
# ... and DotProductAttention's score buffer is allocated on the current CUDA device: the CPU here
torch.cuda.current_device = lambda: "cpu"
# ... and attention's dropout forks the CUDA random state: dropout is 0 here, nothing is drawn
tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
# ... and dist_checkpointing's writer waits for its device-to-host copies: there are none
torch.cuda.synchronize = lambda *args, **kwargs: None
# ... and the router's matmul names Transformer Engine's GEMM, undefined when TE is absent (0.16.1's
# moe_utils.RouterGatingLinearFunction): None takes its torch.mm branch
moe_utils.te_general_gemm = None

VOCAB, PADDED_VOCAB, SEQ, MICRO, GLOBAL = 250, 256, 16, 2, 4  # padded: a multiple of 64 x tensor 2
LR, MIN_LR, WARMUP, DECAY_ITERS, WD = 1e-3, 1e-4, 2, 20, 0.1


def layout(kind: str, verb: str) -> tuple[int, int, int]:
    """(tensor, pipeline, expert) sizes of the run that saves: megatron-core's MoE under tensor parallelism
    needs sequence parallelism, which its torch norms (no Apex or Transformer Engine here) refuse, so the
    mixture of experts is saved by pipeline 2 x expert 2 instead."""
    if verb != "save":
        return 1, 1, 1
    return (1, 2, 2) if kind == "moe" else (2, 2, 1)


def transformer_config(kind: str, tp: int, pp: int, ep: int = 1) -> TransformerConfig:
    common = dict(num_layers=4, hidden_size=64, num_attention_heads=4, tensor_model_parallel_size=tp,
                  pipeline_model_parallel_size=pp, use_cpu_initialization=True, hidden_dropout=0.0,
                  attention_dropout=0.0, init_method_std=0.02, params_dtype=torch.float32, pipeline_dtype=torch.float32,
                  layernorm_epsilon=1e-5, bias_dropout_fusion=False, apply_rope_fusion=False,
                  gradient_accumulation_fusion=False, sequence_parallel=False)
    if kind == "gpt":
        return TransformerConfig(**common, ffn_hidden_size=256, add_bias_linear=True, normalization="LayerNorm",
                                 activation_func=fast_gelu, bias_activation_fusion=False)
    if kind == "shakespeare":  # megatron-core's LayerNorm keeps its bias whatever add_bias_linear says
        return TransformerConfig(**{**common, "hidden_size": 128}, ffn_hidden_size=512, add_bias_linear=False,
                                 normalization="LayerNorm", activation_func=fast_gelu, bias_activation_fusion=False)
    llama = dict(ffn_hidden_size=96, num_query_groups=2, add_bias_linear=False, normalization="RMSNorm",
                 gated_linear_unit=True, activation_func=torch.nn.functional.silu, bias_activation_fusion=False)
    if kind == "llama":
        return TransformerConfig(**common, **llama)
    return TransformerConfig(**common, **llama, expert_model_parallel_size=ep, num_moe_experts=4, moe_router_topk=2,
                             moe_ffn_hidden_size=48, moe_token_dispatcher_type="allgather",
                             moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)


def megatron_args(kind: str, tp: int, pp: int, ep: int, iteration: int) -> argparse.Namespace:
    """The arguments Megatron-LM's ``arguments.py`` saves in a checkpoint (those a conversion reads)."""
    llama = kind != "gpt"
    return argparse.Namespace(
        num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96 if llama else 256,
        kv_channels=16, group_query_attention=llama, num_query_groups=2 if llama else 1,
        seq_length=SEQ, max_position_embeddings=SEQ,
        position_embedding_type="rope" if llama else "learned_absolute", rotary_base=10000, rotary_percent=1.0,
        use_rope_scaling=False, normalization="RMSNorm" if llama else "LayerNorm", norm_epsilon=1e-5,
        swiglu=llama, openai_gelu=not llama, squared_relu=False, add_bias_linear=not llama,
        add_qkv_bias=not llama, qk_layernorm=False, untie_embeddings_and_output_weights=llama,
        apply_layernorm_1p=False, multi_latent_attention=False, mtp_num_layers=None,
        num_experts=4 if kind == "moe" else None, moe_router_topk=2, moe_ffn_hidden_size=48 if kind == "moe" else None,
        moe_router_pre_softmax=False, moe_router_score_function="softmax", moe_shared_expert_intermediate_size=None,
        moe_layer_freq=1, moe_aux_loss_coeff=0.0,
        padded_vocab_size=PADDED_VOCAB, make_vocab_size_divisible_by=64, vocab_size=VOCAB,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02, bf16=False, fp16=False,
        optimizer="adam", lr=LR, min_lr=MIN_LR, lr_decay_style="cosine", lr_warmup_iters=WARMUP,
        lr_decay_iters=DECAY_ITERS, train_iters=DECAY_ITERS, weight_decay=WD, start_weight_decay=WD,
        end_weight_decay=WD, weight_decay_incr_style="constant", adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
        clip_grad=1.0, decoupled_weight_decay=True, micro_batch_size=MICRO, global_batch_size=GLOBAL,
        rampup_batch_size=None, seed=1234, data_path=None, split="969,30,1", consumed_train_samples=iteration * GLOBAL,
        consumed_valid_samples=0, iteration=iteration, use_distributed_optimizer=False, ckpt_format="torch_dist")


def build(kind: str, tp: int, pp: int, ep: int) -> GPTModel:
    cfg = transformer_config(kind, tp, pp, ep)
    gpt = kind in ("gpt", "shakespeare")
    spec = get_gpt_layer_local_spec(num_experts=4 if kind == "moe" else None,
                                    normalization="LayerNorm" if gpt else "RMSNorm")
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=PADDED_VOCAB, max_sequence_length=SEQ,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=gpt,
                    position_embedding_type="learned_absolute" if gpt else "rope")


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def forward(model: GPTModel, tokens: torch.Tensor, labels=None):
    positions = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)  # True: masked (future keys)
    return model(tokens, positions, mask, labels=labels)


def save(kind: str, directory: str, iters: int) -> None:
    tp, pp, ep = layout(kind, "save")
    model = build(kind, tp, pp, ep)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=WD)
    for step in range(iters):
        tokens, labels = batch(step)
        if ps.is_pipeline_first_stage():
            loss = forward(model, tokens).square().mean()  # this stage's part of a loss: its output's scale
        else:
            g = torch.Generator().manual_seed(100 + step)
            model.set_input_tensor(torch.randn(SEQ, MICRO, 64, generator=g))
            loss = forward(model, tokens, labels).float().mean()
        opt.zero_grad()
        loss.backward()
        if kind == "gpt":  # the tied output layer's gradient reaches the first stage's embedding
            _sum_tied_embedding_grads(model)
        opt.step()
    scheduler = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=LR, min_lr=MIN_LR,
                                        lr_warmup_steps=WARMUP * GLOBAL, lr_decay_steps=DECAY_ITERS * GLOBAL,
                                        lr_decay_style="cosine", start_wd=WD, end_wd=WD,
                                        wd_incr_steps=DECAY_ITERS * GLOBAL, wd_incr_style="constant")
    scheduler.step(iters * GLOBAL)
    model_sd = model.sharded_state_dict()
    optim_sd = opt.state_dict()
    step_count = optim_sd["state"][0]["step"]
    optim_state_to_sharding_state(optim_sd, get_param_id_to_sharded_param_map(model_sd, params), exclude_keys="step")
    optim_sd["state"]["common_step"] = step_count
    iter_dir = os.path.join(directory, f"iter_{iters:07d}")
    if torch.distributed.get_rank() == 0:
        os.makedirs(iter_dir, exist_ok=True)
    torch.distributed.barrier()
    state = {"args": megatron_args(kind, tp, pp, ep, iters), "checkpoint_version": 3.0, "iteration": iters,
             "model": model_sd, "optimizer": optim_sd, "opt_param_scheduler": scheduler.state_dict(),
             "num_floating_point_operations_so_far": 0}
    dist_checkpointing.save(state, iter_dir)
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(directory, "latest_checkpointed_iteration.txt"), "w") as fp:
            fp.write(str(iters))


def _sum_tied_embedding_grads(model: GPTModel) -> None:
    """Megatron's ``_allreduce_word_embedding_grads``: the first and last stages' copies of the tied table
    get the sum of both gradients."""
    if ps.is_rank_in_embedding_group():
        w = model.shared_embedding_or_output_weight()
        torch.distributed.all_reduce(w.grad, group=ps.get_embedding_group())


def sharded_adam(opt, model_sd, params) -> dict:
    """AdamW's state as ``FP32Optimizer.sharded_state_dict`` lays it out (``optimizer.state.exp_avg.KEY``...)."""
    optim_sd = opt.state_dict()
    optim_state_to_sharding_state(optim_sd, get_param_id_to_sharded_param_map(model_sd, params), exclude_keys="step")
    return optim_sd


@contextlib.contextmanager
def empty_without_strides():
    """megatron-core 0.19.2's ``load_tensors_metadata`` (behind ``load_plain_tensors``) calls ``torch.empty(size,
    **TensorProperties.__dict__)``, and torch 2.15's TensorProperties has a ``strides`` field that ``torch.empty``
    does not take (``TypeError: empty() got an unexpected keyword argument 'strides'``): inside, that keyword is
    dropped (the tensors it makes are empty ``meta`` ones, for their shapes and dtypes only)."""
    empty = torch.empty
    torch.empty = lambda *args, strides=None, **kwargs: empty(*args, **kwargs)
    try:
        yield
    finally:
        torch.empty = empty


def load(kind: str, directory: str, out: str) -> None:
    """megatron-core's reading of the checkpoint: every tensor whole (``dist_checkpointing.load_plain_tensors``,
    as ``tensor.NAME``); a tensor-1 pipeline-1 model and its AdamW state loaded from it as
    ``FP32Optimizer.sharded_state_dict(is_loading=True)`` lays the state out, that state saved again and read
    whole (``adam.NAME``: what the optimizer holds); the model's logits (``logits``) on a batch (``tokens``)."""
    with open(os.path.join(directory, "latest_checkpointed_iteration.txt")) as fp:
        path = os.path.join(directory, f"iter_{int(fp.read()):07d}")
    with empty_without_strides():
        plain = dist_checkpointing.load_plain_tensors(path)  # with common.pt's entries
    arrays = {f"tensor.{k}": v.float().numpy() for k, v in plain.items() if isinstance(v, torch.Tensor)}
    model = build(kind, 1, 1, 1)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR)
    for p in params:  # the state the checkpoint is loaded into
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    model_sd = model.sharded_state_dict()
    loaded = dist_checkpointing.load({"model": model_sd, "optimizer": sharded_adam(opt, model_sd, params)}, path)
    model.load_state_dict(loaded["model"])
    for i, p in enumerate(params):
        for key in ("exp_avg", "exp_avg_sq"):
            opt.state[p][key].copy_(loaded["optimizer"]["state"][i][key])
    again = out + ".adam"
    os.makedirs(again)
    dist_checkpointing.save({"optimizer": sharded_adam(opt, model.sharded_state_dict(), params)}, again)
    with empty_without_strides():
        again_plain = dist_checkpointing.load_plain_tensors(again)
    arrays.update({f"adam.{k}": v.float().numpy() for k, v in again_plain.items()
                   if isinstance(v, torch.Tensor)})
    tokens, _ = batch(1000)
    with torch.no_grad():
        arrays["logits"] = forward(model, tokens).float().numpy()
    arrays["tokens"] = tokens.numpy()
    np.savez(out, **arrays)


def main() -> None:
    global VOCAB, PADDED_VOCAB, SEQ
    verb, kind, directory, arg = sys.argv[1:5]
    if kind == "shakespeare":
        VOCAB = PADDED_VOCAB = 65  # make_vocab_size_divisible_by=1: no padding
        SEQ = 64
    torch.distributed.init_process_group("gloo")
    tp, pp, ep = layout(kind, verb)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)
    torch.manual_seed(0)
    if verb == "save":
        save(kind, directory, int(arg))
    else:
        load(kind, directory, arg)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
