"""Text generation CLI: ``python -m jaxllm.generate --workdir DIR --prompt "..."``.

Samples from the last checkpoint of a training run (see :mod:`jaxllm.sampling`).
"""

from __future__ import annotations

import sys

import numpy as np
from absl import app, flags, logging

from jaxllm import checkpoint, model
from jaxllm.data import Data
from jaxllm.sampling import Sampler

def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file it reads at INFO
    F = flags.FLAGS
    try:
        cfg = checkpoint.load_config(F.workdir)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if F.temperature <= 0:
        print(f"error: --temperature={F.temperature}: must be > 0", file=sys.stderr)
        sys.exit(2)
    tokenizer = Data(cfg, F.workdir, splits=()).tokenizer
    params = checkpoint.restore_params(cfg, F.workdir)  # on this host, whatever mesh the run used
    graphdef, _ = model.abstract(cfg)
    prompt = tokenizer.encode(F.prompt or "\n")
    sampler = Sampler(cfg, graphdef, params)
    new = sampler(np.tile(np.asarray(prompt)[None], (F.num_samples, 1)), F.num_tokens,
                  temperature=F.temperature, top_k=F.top_k, seed=F.seed)
    for row in new:
        print(F.prompt + tokenizer.decode(row.tolist()))
        print("-" * 40)


if __name__ == "__main__":
    flags.DEFINE_string("workdir", None, "training run directory (holds checkpoints/)", required=True)
    flags.DEFINE_string("prompt", "", "text to continue; empty: start from a newline")
    flags.DEFINE_integer("num_tokens", 256, "tokens to generate per sample")
    flags.DEFINE_integer("num_samples", 1, "samples to draw")
    flags.DEFINE_float("temperature", 0.8, "softmax temperature (> 0)")
    flags.DEFINE_integer("top_k", 200, "sample among the k most likely tokens (0: all)")
    flags.DEFINE_integer("seed", 0, "sampling seed")
    app.run(main)
