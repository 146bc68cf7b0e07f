"""GPT model sizes, keyed as in Megatron-DeepSpeed's ALCF scripts (MODEL_SIZE_KEY).

    python -m jaxllm.train --config=configs/gpt3.py:GPT125M --config.data.input=...

GPT22B, GPT175B and GPT1T are the models of the Frontier study (Dash et al.
2023, "Optimizing Distributed Training on Frontier for Large Language Models").
Every size uses GPT-2's BPE (vocabulary 50257, padded to 50304), sequence 2048,
learned positions, LayerNorm and GELU, as GPT-3 (Brown et al. 2020, Table 2.1).
"""

import os

from jaxllm.config import get_config as defaults

# key: (num_layers, hidden_size, num_attention_heads)
SIZES = {
    "GPT125M": (12, 768, 12),
    "GPT350M": (24, 1024, 16),
    "GPT1_5B": (48, 1536, 24),
    "GPT2_7B": (32, 2560, 32),
    "GPT6_7B": (32, 4096, 32),
    "GPT13B": (40, 5120, 40),
    "GPT22B": (48, 6144, 48),
    "GPT175B": (96, 12288, 96),
    "GPT1T": (128, 25600, 160),
}

GPT2_DIR = os.path.normpath(os.path.join(os.path.dirname(os.path.realpath(__file__)),
                                        "..", "..", "shared", "data", "gpt2"))


def get_config(key="GPT125M"):
    if key not in SIZES:
        raise ValueError(f"configs/gpt3.py:{key}: unknown size; choose one of {', '.join(SIZES)}")
    layers, hidden, heads = SIZES[key]
    c = defaults()
    c.model.update(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, dtype="bfloat16")
    c.train.update(seq_length=2048, micro_batch_size=1, global_batch_size=8, lr=3e-4, min_lr=3e-5,
                   warmup_iters=100, train_iters=1000)
    c.data.update(tokenizer="gpt2", gpt2_dir=GPT2_DIR)
    return c
