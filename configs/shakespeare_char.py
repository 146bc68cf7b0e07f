"""nanoGPT's CPU recipe for character-level Tiny Shakespeare.

nanoGPT (karpathy/nanoGPT, README "I only have a macbook"): 4 layers, 4 heads,
128 hidden, context 64, batch 12, 2000 iterations, lr 1e-3 -> 1e-4 cosine with
100 warmup, beta2 0.99, weight decay 0.1, clip 1.0, no dropout, no biases,
first 90% of the text for training and the last 10% for validation; it reports
validation loss 1.88.

    python -m jaxllm.train --config=configs/shakespeare_char.py --workdir=runs/shakespeare

The text ships with the repository: ``tests/data/tinyshakespeare.txt`` (char-rnn's
``data/tinyshakespeare/input.txt``, the file nanoGPT downloads; 1,115,394 bytes of Shakespeare's
plays, public domain; the tests train on it too). ``--config.data.input=PATH`` trains on another text.
"""

import os

from jaxllm.config import get_config as defaults

TINY_SHAKESPEARE = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "tests", "data",
                                "tinyshakespeare.txt")


def get_config():
    c = defaults()
    c.model.update(num_layers=4, num_attention_heads=4, hidden_size=128, use_bias=False, dropout=0.0,
                   make_vocab_size_divisible_by=1, dtype="float32")
    c.train.update(seq_length=64, micro_batch_size=12, global_batch_size=12, train_iters=2000, lr=1e-3,
                   min_lr=1e-4, warmup_iters=100, lr_decay_iters=2000, beta2=0.99, weight_decay=0.1,
                   grad_clip=1.0, eval_interval=250, eval_iters=200, log_interval=100)
    # nanoGPT's random windows over the first 90% of the characters, validation on the last 10%
    c.data.update(input=TINY_SHAKESPEARE, tokenizer="char", sampling="uniform", split="9,1")
    c.log.sample_tokens = 500
    return c
