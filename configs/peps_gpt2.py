"""A small GPT on the Python Enhancement Proposals, GPT-2 BPE: the end-to-end run of README.

The corpus is yours to give, as ``--config.data.input=PATH`` (without it: one line, exit 2): a
text file of the PEPs (github.com/python/peps, the 703 that state public domain or CC0; 13.9 MB
of English technical prose with reST markup, 3.96M GPT-2 tokens), each document beginning with a
line ``<|file|> peps/pep-NNNN.rst``. One document per PEP, the first 90% of them train, the last
10% validation, sampled in Megatron-LM's order, tokenized with GPT-2's BPE (the files shipped
with jaxllm).  4 layers, 4 heads, hidden 128, context 128, tied embeddings (the 50k-entry
vocabulary is most of the parameters and of the FLOPs), float32.

    launch/local.sh 2 --config=configs/peps_gpt2.py --workdir=runs/peps --config.data.input=PATH/peps.txt \\
        --config.mesh.data=2 --config.mesh.pipeline=2 --config.mesh.tensor=2
"""

from jaxllm.config import get_config as defaults


def get_config():
    c = defaults()
    c.model.update(num_layers=4, num_attention_heads=4, hidden_size=128, dropout=0.0, dtype="float32")
    c.train.update(seq_length=128, micro_batch_size=2, global_batch_size=16, train_iters=800, lr=2e-3,
                   min_lr=2e-4, warmup_iters=50, eval_interval=100, eval_iters=20, log_interval=20)
    # no default corpus: data.input must name the PEPs file
    c.data.update(input="", tokenizer="gpt2", document_marker="<|file|>", split="9,1,0")
    c.checkpoint.interval = 100
    c.log.sample_prompt = "This PEP proposes"
    return c
