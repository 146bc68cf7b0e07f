"""GPT model sizes, keyed as ALCF's Megatron-DeepSpeed scripts key them (``MODEL_SIZE_KEY``).

    python -m jaxllm.train --config=configs/gpt3.py:GPT125M --config.data.input=...

The keys and shapes (layers, hidden size, attention heads) are those of ``ALCF/model.sh`` in
argonne-lcf/Megatron-DeepSpeed, every key it defines, with its numbers (the copy read: the fork
samanta-amit/Megatron-DeepSpeed at commit 39a484d2ea04c2b3714adc15ef2fe363f841e77f, the version with
the GPT1T_*L keys; ALCF/pre-AuroraGPT/model.sh of later commits has the same GPT keys). Three keys
are not in model.sh: GPT350M, the GPT-3 paper's (Brown et al. 2020, Table 2.1), and GPT22B,
GPT175B and GPT1T, the models of the Frontier study (Dash et al. 2023, "Optimizing Distributed
Training on Frontier for Large Language Models"), with the shapes of the study's own launch
scripts (sajal-vt/Megatron-DeepSpeed-ORNL: launch_gpt22b_bf16.slurm, launch_gpt175b_srun.frontier,
launch_gpt1T_srun.frontier).

Every size uses GPT-2's BPE (the files shipped with jaxllm; vocabulary 50257, padded to a multiple of
128 x the tensor-parallel size: 50304 on one tensor device), sequence 2048, learned positions, LayerNorm and
GELU (4 x hidden), biases and tied embeddings, as GPT-3 and ALCF's GPT-3 runs (``NO_LLAMA=1``).
"""

from jaxllm.config import get_config as defaults

# key: (num_layers, hidden_size, num_attention_heads)
SIZES = {
    # ALCF/model.sh's heads; GPT-3's paper has 12 (head dim 64), model.sh 16 (head dim 48)
    "GPT125M": (12, 768, 16),
    # not in model.sh: GPT-3 Medium (Brown et al. 2020, Table 2.1)
    "GPT350M": (24, 1024, 16),
    # model.sh's "BERT1.2B" key: a BERT-large-like shape (head dim 16), trained as a GPT by ALCF's scripts
    "BERT1.2B": (24, 2048, 128),
    # model.sh: 48 x 1536, 24 heads; not a GPT-3 paper size (GPT-3 XL, 1.3B: 24 x 2048, 24 heads;
    # GPT-2's 1.5B: 48 x 1600, 25 heads)
    "GPT1_5B": (48, 1536, 24),
    "GPT2_7B": (32, 2560, 32),  # = GPT-3 2.7B
    "GPT6_7B": (32, 4096, 32),  # = GPT-3 6.7B
    # model.sh's heads; GPT-3's paper has 40 (head dim 128), model.sh 64 (head dim 80)
    "GPT13B": (40, 5120, 64),
    # model.sh's GPT25B (the long-context runs' model) and GPT30B have the same shape (64 x 6144, 64 heads);
    # its commented-out 25B variants (5760 x 64 or 80 heads, 5888 x 46) are not keys
    "GPT25B": (64, 6144, 64),
    "GPT30B": (64, 6144, 64),
    "GPT33B": (80, 6144, 64),  # model.sh's key (its commented-out 33B: 80 x 5760, 80 heads)
    "GPT145B": (80, 12288, 96),
    # the Frontier study's (not in model.sh)
    "GPT22B": (48, 6144, 48),
    "GPT175B": (96, 12288, 96),  # = GPT-3 175B
    # the study's 1T script has 128 heads (head dim 200); model.sh's GPT1T_128L below has 160 (head dim 160)
    "GPT1T": (128, 25600, 128),
}
# model.sh's GPT145B with fewer layers (GPT145B_2L ... GPT145B_64L: scaling and debugging runs)
SIZES.update({f"GPT145B_{n}L": (n, 12288, 96) for n in (2, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)})
# model.sh's 1T width (MODEL_1T_HIDDEN=25600, MODEL_1T_ATEN_HEADS=160) at GPT1T_1L ... GPT1T_1024L layers
SIZES.update({f"GPT1T_{n}L": (n, 25600, 160) for n in (1, 2, 4, 8, 16, 24, 30, 32, 60, 64, 120, 128, 256, 512,
                                                        1024)})


def get_config(key="GPT125M"):
    if key not in SIZES:
        raise ValueError(f"configs/gpt3.py:{key}: unknown size; choose one of {', '.join(SIZES)}")
    layers, hidden, heads = SIZES[key]
    c = defaults()
    c.model.update(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, dtype="bfloat16")
    c.train.update(seq_length=2048, micro_batch_size=1, global_batch_size=8, lr=3e-4, min_lr=3e-5,
                   warmup_iters=100, train_iters=1000)
    c.data.tokenizer = "gpt2"  # data.gpt2_dir empty: the files shipped with jaxllm
    return c
