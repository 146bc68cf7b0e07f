"""Long-sequence recipes: the DeepSpeed4Science run of ALCF's Megatron-DeepSpeed, in jaxllm keys.

    python -m jaxllm.plan --config=configs/long_context.py:DS4Science --devices=32 --device=A100-40GB
    python -m jaxllm.train --config=configs/long_context.py:DS4Science --config.data.input=... --workdir=DIR

The run (DeepSpeed4Science's long-sequence support for genome-scale language models, trained with
ALCF's Megatron-DeepSpeed): GPT25B of ALCF's ``model.sh`` (64 layers, hidden 6144, 64 heads;
``configs/gpt3.py``) with rotary positions, about 420k tokens per sequence on 32 A100-40GB GPUs,
``SP_TYPE=ds`` (DeepSpeed-Ulysses over all 32 GPUs), ``ZERO_STAGE=3`` across them and full
activation checkpointing (``--checkpoint-activations``), one sequence per step.  The recipe's
length, 430,080 = 420 x 1,024 tokens, is divisible by the 32 devices (13,440 each) and by Ulysses'
64 heads.  ``parallel.sequence_impl`` and ``mesh.sequence`` are the layout; the model is
``configs/gpt3.py:GPT25B``'s.  Memory: each layer is recomputed in the backward pass, as with full
activation checkpointing, and its input is kept in host memory (``model.remat=offload``: 9.84 GiB
per device of the plan's A100-40GB memory), and the MLP runs over each device's 13,440 tokens in 8
chunks (``model.mlp_chunks=8``: its ``[tokens, 24,576]`` intermediates one chunk at a time).

Keys:
  DS4Science       Ulysses over 32 devices (``mesh.sequence=32``), ZeRO-3 over them.
  DS4Science-ring  the same model and length with ring attention (zigzag load balance) in place of
                   Ulysses: the layout for more devices than heads, or without an all-to-all.
  DS4Science-usp   USP on 8 nodes of 4 GPUs (Polaris'): Ulysses inside each node
                   (``mesh.sequence=4``, the default ``parallel.ulysses_degree``), ring attention
                   across the nodes (``mesh.dcn_sequence=8``).

What the plans of these recipes say on each GPU, and how to choose between the implementations:
docs/long-context.md.
"""

import importlib.util
from pathlib import Path

# configs/gpt3.py beside this file, whatever the working directory (config files are loaded by path)
_spec = importlib.util.spec_from_file_location("jaxllm_configs_gpt3", Path(__file__).with_name("gpt3.py"))
_gpt3 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gpt3)

SEQ_LENGTH = 430_080  # 420 x 1,024 tokens: DeepSpeed4Science's ~420k, divisible by 32 devices and 64 heads
ONE_GROUP = {"sequence": 32}  # 32 devices on the sequence axis
NODES = {"sequence": 4, "dcn_sequence": 8}  # the same 32: 4 in each of 8 nodes
RECIPES = {"DS4Science": ("ulysses", ONE_GROUP), "DS4Science-ring": ("ring", ONE_GROUP),
           "DS4Science-usp": ("usp", NODES)}


def get_config(key="DS4Science"):
    if key not in RECIPES:
        raise ValueError(f"configs/long_context.py:{key}: unknown recipe; choose one of {', '.join(RECIPES)}")
    impl, mesh = RECIPES[key]
    c = _gpt3.get_config("GPT25B")
    c.model.update(position_embedding="rotary", remat="offload", mlp_chunks=8)
    c.train.update(seq_length=SEQ_LENGTH, micro_batch_size=1, global_batch_size=1)
    c.mesh.update(**mesh)
    c.parallel.update(sequence_impl=impl, zero_stage=3)
    return c
