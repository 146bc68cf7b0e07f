"""A small GPT on Python's standard library, GPT-2 BPE: the end-to-end run of README.

The corpus is one every user has: the standard library of the Python that runs jaxllm (the
default ``data.input``, ``sysconfig.get_paths()["stdlib"]``; on CPython 3.11.7: 1,904 files,
32.0 MB, 1,875 documents, 15.5M GPT-2 tokens), one document per ``.py``/``.txt``/``.rst``/``.md``
file in sorted order, ``site-packages`` skipped. The first 90% of the documents train, the last
10% validate, sampled in Megatron-LM's order, tokenized with GPT-2's BPE (the files shipped with
jaxllm). Another Python version gives another corpus, so its losses differ a little.
``--config.data.input=PATH`` trains on your own text instead. 4 layers, 4 heads, hidden 128,
context 128, tied embeddings (the 50k-entry vocabulary is most of the parameters and of the
FLOPs), float32.

    launch/local.sh 2 --config=configs/python_gpt2.py --workdir=runs/python \\
        --config.mesh.data=2 --config.mesh.pipeline=2 --config.mesh.tensor=2
"""

from jaxllm.config import get_config as defaults


def get_config():
    c = defaults()
    c.model.update(num_layers=4, num_attention_heads=4, hidden_size=128, dropout=0.0, dtype="float32")
    c.train.update(seq_length=128, micro_batch_size=2, global_batch_size=16, train_iters=600, lr=2e-3,
                   min_lr=2e-4, warmup_iters=50, eval_interval=100, eval_iters=20, log_interval=20)
    c.data.update(tokenizer="gpt2", split="9,1,0")
    c.checkpoint.interval = 100
    c.log.sample_prompt = "def"
    return c
