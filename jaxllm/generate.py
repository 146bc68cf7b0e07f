"""Text generation CLI: ``python -m jaxllm.generate --workdir DIR --prompt "..."``.

Samples from the last checkpoint of a training run (:func:`jaxllm.load`, then the KV-cache sampler of
:mod:`jaxllm.runtime.sampling`), on this host whatever mesh the run used.
"""

from __future__ import annotations

import numpy as np
from absl import flags, logging

from jaxllm import api, cli


@cli.stoppable("jaxllm.generate")
def _main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file it reads at INFO
    F = flags.FLAGS
    if F.temperature <= 0:
        cli.fail(f"error: --temperature={F.temperature}: must be > 0")
    with cli.usage_errors({FileNotFoundError: "error: "}):
        run = api.load(F.workdir)
    prompt = np.asarray(run.tokenizer.encode(F.prompt or "\n"))
    new = run.sample(np.tile(prompt[None], (F.num_samples, 1)), F.num_tokens, temperature=F.temperature,
                     top_k=F.top_k, seed=F.seed)
    for row in new:
        print(F.prompt + run.tokenizer.decode(row.tolist()))
        print("-" * 40)


def define_flags(fv, argv) -> None:
    """``python -m jaxllm.generate``'s flags, in the ``FlagValues`` ``fv`` (``argv``: the command's arguments)."""
    flags.DEFINE_string("workdir", None, "training run directory (holds checkpoints/)", required=True, flag_values=fv)
    flags.DEFINE_string("prompt", "", "text to continue; empty: start from a newline", flag_values=fv)
    flags.DEFINE_integer("num_tokens", 256, "tokens to generate per sample", flag_values=fv)
    flags.DEFINE_integer("num_samples", 1, "samples to draw", flag_values=fv)
    flags.DEFINE_float("temperature", 0.8, "softmax temperature (> 0)", flag_values=fv)
    flags.DEFINE_integer("top_k", 200, "sample among the k most likely tokens (0: all)", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "sampling seed", flag_values=fv)


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxllm.generate ARGV``; with ``argv`` (a list) in this process, returning the exit status
    (:func:`jaxllm.cli.run_tool`)."""
    return cli.run_tool(_main, define_flags, argv)


if __name__ == "__main__":
    main()
