"""Long-sequence recipes: the DeepSpeed4Science run of ALCF's Megatron-DeepSpeed, in jaxllm keys.

    python -m jaxllm.plan --config=configs/long_context.py:DS4Science --devices=32 --device=A100-40GB
    python -m jaxllm.train --config=configs/long_context.py:DS4Science --config.data.input=... --workdir=DIR

The run (DeepSpeed4Science's long-sequence support for genome-scale language models, trained with
ALCF's Megatron-DeepSpeed): GPT25B of ALCF's ``model.sh`` (64 layers, hidden 6144, 64 heads;
``configs/gpt3.py``) with rotary positions, about 420k tokens per sequence on 32 A100-40GB GPUs,
``SP_TYPE=ds`` (DeepSpeed-Ulysses over all 32 GPUs), ``ZERO_STAGE=3`` across them and full
activation checkpointing (``--checkpoint-activations``), one sequence per step.  The recipe's
length, 430,080 = 420 x 1,024 tokens, is divisible by the 32 devices (13,440 each) and by Ulysses'
64 heads.  ``parallel.sequence_impl`` and ``mesh.sequence`` are the layout; everything else is
``configs/gpt3.py:GPT25B``'s.

Keys:
  DS4Science       Ulysses over 32 devices (``mesh.sequence=32``), ZeRO-3 over them, full remat.
  DS4Science-ring  the same model and length with ring attention (zigzag load balance) in place of
                   Ulysses: the layout for more devices than heads, or without an all-to-all.

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
IMPLS = {"DS4Science": "ulysses", "DS4Science-ring": "ring"}


def get_config(key="DS4Science"):
    if key not in IMPLS:
        raise ValueError(f"configs/long_context.py:{key}: unknown recipe; choose one of {', '.join(IMPLS)}")
    c = _gpt3.get_config("GPT25B")
    c.model.update(position_embedding="rotary", remat="full")
    c.train.update(seq_length=SEQ_LENGTH, micro_batch_size=1, global_batch_size=1)
    c.mesh.sequence = 32
    c.parallel.update(sequence_impl=IMPLS[key], zero_stage=3)
    return c
