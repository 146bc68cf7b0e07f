"""The batches a run trains (or evaluates) on, as a file: what the model sees, token for token.

    python -m jaxllm.inspect_data [--config=FILE] [--config.KEY=VALUE ...] --workdir=DIR \\
        --steps=A:B [--split=train|valid] --output=FILE.npy

takes the same config flags as ``python -m jaxllm.train`` and writes the global batches of
steps A..B-1 as int32 ``[B - A, global_batch_size, seq_length + 1]`` (each sample's tokens:
the inputs, then the last target). With ``--split=valid``: the validation batches, in the
order Megatron-LM's run evaluates them (batch ``i`` = samples ``[i x global batch, (i + 1) x
global batch)`` of the validation split; Megatron's evaluations read on from one to the next).
It prints the data's summary, the start of the first row decoded, and the share of each
dataset (or corpus) in these batches next to its weight. Exit code 2 on bad data or config.
"""

from __future__ import annotations

import os
import re
import uuid

import numpy as np
from absl import flags, logging

from jaxllm import cli
from jaxllm.data.loader import Batches, Data
from jaxllm.errors import DataError
from jaxllm.resolve import resolve


def parse_steps(text: str) -> tuple[int, int]:
    """``"A:B"`` -> (A, B) with 0 <= A < B. Raises DataError otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text or "")
    if not m or int(m.group(1)) >= int(m.group(2)):
        raise DataError(f"--steps={text!r}: give A:B with 0 <= A < B (steps A..B-1), e.g. --steps=0:10")
    return int(m.group(1)), int(m.group(2))


def proportions(data: Data, split: str, first: int, count: int) -> list[tuple[str, int, float | None]]:
    """(dataset or corpus, samples among ``count`` from sample ``first`` of ``split``, its normalized weight)."""
    src = data.sample_source(split, np.arange(first, first + count))
    by_dataset = np.bincount(src, minlength=len(data.datasets))
    names, groups = data.blend.corpora, {}
    for i, name in enumerate(names):
        n, w = groups.get(name, (0, 0.0))
        groups[name] = (n + int(by_dataset[i]), w + (data.weights[i] if data.weights else 0.0))
    return [(name, n, w if data.weights else None) for name, (n, w) in groups.items()]


def write_batches(data: Data, split: str, steps: tuple[int, int], output: str) -> np.ndarray:
    """Writes the batches of ``steps`` to ``output`` (.npy, via a temporary file renamed into place)."""
    batches = Batches(data, check_vocab=False)
    out = np.stack([batches.batch(split, i) for i in range(*steps)]).astype(np.int32)
    output = os.path.abspath(output)
    os.makedirs(os.path.dirname(output), exist_ok=True)
    tmp = f"{output}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}.npy"
    try:
        np.save(tmp, out, allow_pickle=False)
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@cli.stoppable("jaxllm.inspect_data")
def _main(argv):
    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        cli.fail(f"error: unexpected arguments: {' '.join(argv[1:])}")
    F = flags.FLAGS
    with cli.usage_errors():
        steps = parse_steps(F.steps)
        if not F.output.endswith(".npy"):
            raise DataError(f"--output={F.output!r}: give a FILE.npy")
        cli.check_output("--output", F.output, directory=False)
        cli.check_output("--workdir", F.workdir)  # the data's sample indices (and text's tokens) go there
        cfg = F.config
        resolve(cfg, num_devices=None)  # the data do not depend on the devices: the mesh as written
        data = Data(cfg, F.workdir, splits=(F.split,))
        out = write_batches(data, F.split, steps, F.output)
    print(data.describe())
    print(f"wrote {F.output}: int32 {list(out.shape)} = steps {steps[0]}..{steps[1] - 1} of the {F.split} split, "
          f"global batch {data.global_batch_size}, seq_length {data.seq_length} + 1")
    if int(out.max()) >= data.vocab_size:
        print(f"note: token ids up to {int(out.max())} exceed the {data.tokenizer.name} tokenizer's vocabulary of "
              f"{data.vocab_size}: set data.tokenizer to the data's tokenizer to decode them (and to train)")
    text = data.tokenizer.decode(out[0, 0].tolist())
    print(f"first row, decoded (first 300 characters): {text[:300]!r}")
    gb = data.global_batch_size
    rows = proportions(data, F.split, steps[0] * gb, (steps[1] - steps[0]) * gb)
    total = max(1, sum(n for _, n, _ in rows))
    print(f"{'dataset' if len(rows) == len(data.datasets) else 'corpus':<40} {'samples':>9} {'share':>8} {'weight':>8}")
    for name, n, w in rows:
        print(f"{name[-40:]:<40} {n:>9,} {n / total:>8.4f} {'' if w is None else f'{w:.4f}':>8}")


def define_flags(fv, argv) -> None:
    """``python -m jaxllm.inspect_data``'s flags, in the ``FlagValues`` ``fv`` (``argv``: the command's arguments)."""
    cli.define_config_flag(argv, fv)
    flags.DEFINE_string("workdir", "runs/default", "run directory (text inputs are prepared into WORKDIR/data)",
                        flag_values=fv)
    flags.DEFINE_string("steps", None, "A:B: the batches of steps A..B-1", required=True, flag_values=fv)
    flags.DEFINE_enum("split", "train", ["train", "valid"], "train, or valid: the validation batches", flag_values=fv)
    flags.DEFINE_string("output", None, "FILE.npy to write", required=True, flag_values=fv)


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxllm.inspect_data ARGV``; with ``argv`` (a list) in this process, returning the exit status
    (:func:`jaxllm.cli.run_tool`)."""
    return cli.run_tool(_main, define_flags, argv)


if __name__ == "__main__":
    main()
