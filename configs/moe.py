"""Mixture-of-experts recipes: Llama's layer (configs/llama.py's recipe) with its MLP a mixture of experts.

    python -m jaxllm.train --config=configs/moe.py:tiny --workdir=runs/moe
    python -m jaxllm.train --config=configs/moe.py:Mixtral-8x7B --config.mesh.expert=8 --config.data.tokenizer=PATH ...

Keys:
  tiny          4 experts, top-2, 2 layers of hidden 64 for CPUs, tests and demos (byte tokenizer); the
                load-balancing loss at Megatron-LM's usual 1e-2 and a router z-loss of 1e-3 (ST-MoE's).
  Mixtral-8x7B  Mixtral's shape, transformers' MixtralConfig defaults (its docstring names
                mistralai/Mixtral-8x7B-v0.1): 32 layers, hidden 4096, 32 heads, 8 key/value heads, 8 experts of
                FFN 14336, top-2, vocabulary 32000, RMSNorm eps 1e-5, rotary base 1e6; 46.7B parameters, 12.9B
                active per token.  Sequences of 4096 tokens (the model takes 32k: Jiang et al. 2024, "Mixtral
                of Experts"); no capacity (dropless, as Mixtral); the load-balancing loss at 1e-2.  Each
                expert group (mesh.expert) holds 8 / mesh.expert of the experts.

Option names are Megatron-LM's (``model.num_experts`` is ``--num-experts``, ``mesh.expert`` is
``--expert-model-parallel-size``); docs/moe.md has the rest.
"""

import importlib.util
from pathlib import Path

from jaxllm.families import registry

_spec = importlib.util.spec_from_file_location("jaxllm_configs_llama", Path(__file__).with_name("llama.py"))
_llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_llama)

KEYS = ("tiny", "Mixtral-8x7B")


def get_config(key="tiny"):
    if key not in KEYS:
        raise ValueError(f"configs/moe.py:{key}: unknown key; choose one of {', '.join(KEYS)}")
    c = _llama.get_config("tiny")  # train_llama_alcf.sh's recipe (configs/llama.py)
    if key == "tiny":
        c.model.update(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128, moe_aux_loss_coeff=1e-2,
                       moe_z_loss_coeff=1e-3)
        return c
    c.model.update(**registry.SIZES["Mixtral-8x7B"], make_vocab_size_divisible_by=128, moe_aux_loss_coeff=1e-2,
                   dtype="bfloat16", remat="full")
    c.train.update(seq_length=4096, micro_batch_size=1, global_batch_size=8, train_iters=1000, eval_interval=100,
                   eval_iters=20, log_interval=20)
    c.data.tokenizer = ""  # Mixtral's tokenizer.json: --config.data.tokenizer=PATH
    return c
