"""Text generation CLI: ``python -m jaxllm.generate --workdir DIR --prompt "..."``.

Samples from the last checkpoint of a training run (see :mod:`jaxllm.runtime.sampling`), on this
host whatever mesh the run used.
"""

from __future__ import annotations

import numpy as np
from absl import app, flags, logging

from jaxllm import cli, model
from jaxllm.data import Data, DataError
from jaxllm.resolve import resolve_model
from jaxllm.runtime import checkpoint
from jaxllm.runtime.sampling import Sampler


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file it reads at INFO
    F = flags.FLAGS
    if F.temperature <= 0:
        cli.fail(f"error: --temperature={F.temperature}: must be > 0")
    try:
        saved = checkpoint.load_config(F.workdir)
        tokenizer = Data(saved, F.workdir, splits=()).tokenizer
    except FileNotFoundError as e:
        cli.fail(f"error: {e}")
    except DataError as e:
        cli.fail(f"data error: {e}")
    model_cfg = resolve_model(saved.model, seq_length=saved.train.seq_length)
    params = checkpoint.restore_params(model_cfg, F.workdir)
    prompt = tokenizer.encode(F.prompt or "\n")
    sampler = Sampler(model_cfg, model.describe(model_cfg).graphdef, params, saved.train.seq_length)
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
    app.run(main, flags_parser=cli.parse_flags)
