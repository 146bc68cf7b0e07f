"""``python -m jaxllm.convert``: jaxllm workdirs <-> other frameworks' checkpoints, the command line over
:mod:`jaxllm.formats`.

CLI::

    python -m jaxllm.convert --to-hf WORKDIR OUT [--step N]
    python -m jaxllm.convert --from-hf DIR WORKDIR [--config.SECTION.KEY=VALUE ...]
    python -m jaxllm.convert --to-megatron WORKDIR OUT [--step N]
    python -m jaxllm.convert --from-megatron DIR WORKDIR [--iteration N] [--config.SECTION.KEY=VALUE ...]

``--to-hf`` / ``--from-hf``: Hugging Face directories (config.json + safetensors, the tokenizer's files) of every
architecture :mod:`jaxllm.families` registers (:mod:`jaxllm.formats.hf_workdir`; docs/checkpoints.md,
docs/open-models.md).  ``--to-megatron`` / ``--from-megatron``: Megatron-LM ``torch_dist`` checkpoints with Adam's
state, schedule and data position, and Megatron-DeepSpeed's DeepSpeed checkpoints
(:mod:`jaxllm.formats.megatron_workdir`).  An import writes a checkpoint and ``WORKDIR/config.py`` into a workdir
that holds none; ``--config.SECTION.KEY=VALUE`` changes jaxllm's defaults there (of the model keys only
:data:`jaxllm.formats.workdir.FREE_MODEL_KEYS`).  Errors are one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from jaxllm import cli
from jaxllm.errors import ConvertError, DataError
from jaxllm.families.registry import ARCHITECTURES
from jaxllm.formats.hf import hf_architecture
from jaxllm.formats.hf_workdir import export_workdir, import_to_workdir
from jaxllm.formats.megatron_workdir import export_megatron, import_megatron
from jaxllm.runtime.checkpoint import EXIT_SAVE_FAILED, SaveError  # an import's too: nothing is left


def _megatron_main(args: argparse.Namespace, overrides: dict[str, str]) -> int:
    if args.to_megatron:
        workdir, out = args.to_megatron
        iteration = export_megatron(workdir, out, args.step)
        print(f"wrote iteration {iteration} of {workdir} to {out} (Megatron-LM torch_dist, with Adam's state)")
        return 0
    directory, workdir = args.from_megatron
    cfg, iteration, notes = import_megatron(directory, workdir, args.iteration, overrides)
    for line in notes:
        print(f"note: {line}", file=sys.stderr)
    config_py = os.path.join(workdir, "config.py")
    print(f"imported iteration {iteration} of {directory} into {workdir} (step {iteration}, "
          f"data.input={cfg.data.input}, data.tokenizer={cfg.data.tokenizer})\n"
          f"train on:  python -m jaxllm.train --config={config_py} --workdir={workdir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The CLI (see the module docstring); errors are one line on stderr and exit status 2."""
    p = argparse.ArgumentParser(
        prog="python -m jaxllm.convert",
        description="Convert between jaxllm checkpoints and Hugging Face directories (safetensors: "
                    f"{', '.join(a.hf_class for a in ARCHITECTURES.values())}) or Megatron-LM / Megatron-DeepSpeed "
                    "checkpoints (see the module docstring).",
        epilog="--from-hf also takes --config.SECTION.KEY=VALUE options (e.g. --config.data.input=FILE, "
               "--config.data.tokenizer=char): the data must be tokenized with the model's tokenizer.")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--to-hf", nargs=2, metavar=("WORKDIR", "OUT"),
                      help="export WORKDIR's latest checkpoint to the Hugging Face directory OUT")
    mode.add_argument("--from-hf", nargs=2, metavar=("DIR", "WORKDIR"),
                      help="import the Hugging Face directory DIR as a step-0 checkpoint in WORKDIR")
    mode.add_argument("--from-megatron", nargs=2, metavar=("DIR", "WORKDIR"),
                      help="import the Megatron-LM torch_dist checkpoint DIR, or Megatron-DeepSpeed's DeepSpeed "
                           "checkpoint DIR (native or universal), with its optimizer state into WORKDIR")
    mode.add_argument("--to-megatron", nargs=2, metavar=("WORKDIR", "OUT"),
                      help="export WORKDIR's latest checkpoint (with its optimizer state) as a Megatron-LM "
                           "torch_dist checkpoint in OUT")
    p.add_argument("--step", type=int, default=None,
                   help="--to-hf, --to-megatron: the checkpoint step (default: latest)")
    p.add_argument("--iteration", type=int, default=None,
                   help="--from-megatron: the iteration (default: latest_checkpointed_iteration.txt's, or "
                        "DeepSpeed's latest tag)")
    args, rest = p.parse_known_args(argv)
    overrides = {}
    for item in rest:
        m = re.fullmatch(r"--config\.([A-Za-z_]\w*\.[A-Za-z_]\w*)=(.*)", item)
        exporting = args.to_hf or args.to_megatron
        if not m or exporting:
            p.error(f"unrecognized argument {item!r}" + (" (an export takes no --config options)" if exporting else ""))
        overrides[m.group(1)] = m.group(2)
    from absl import logging

    logging.set_verbosity(logging.WARNING)  # Orbax logs every file at INFO
    # OSError: a file missing, unreadable or unwritable; a checkpoint not saved (a full disk): jaxllm.train's status
    try:
        with cli.stoppable("jaxllm.convert", "nothing written (an import's or export's files appear whole or not "
                           "at all)"):
            return _main(args, overrides)
    except SaveError as e:
        cli.fail(f"error: {e}", EXIT_SAVE_FAILED)


def _main(args: argparse.Namespace, overrides: dict[str, str]) -> int:
    with cli.usage_errors(dict.fromkeys((ConvertError, DataError, OSError), "error: ")):
        for mode in ("to_hf", "from_hf", "from_megatron", "to_megatron"):
            if getattr(args, mode):  # the folder it writes, before anything is read
                written = "OUT" if mode.startswith("to") else "WORKDIR"
                cli.check_output(f"--{mode.replace('_', '-')} {written}", getattr(args, mode)[1])
        if args.to_megatron or args.from_megatron:
            return _megatron_main(args, overrides)
        if args.to_hf:
            workdir, out = args.to_hf
            hf = export_workdir(workdir, out, args.step)
            print(f"wrote {hf['architectures'][0]} ({hf['vocab_size']} vocab) to {out}")
            return 0
        directory, workdir = args.from_hf
        cfg = import_to_workdir(directory, workdir, overrides)
    config_py = os.path.join(workdir, "config.py")
    if not any(k.startswith("data.") for k in overrides) and cfg.data.tokenizer in ("char", "byte"):
        print(f"note: {directory} holds no tokenizer for this model (GPT-2's vocab.json + merges.txt, a "
              f"tokenizer.json or a SentencePiece tokenizer.model), so the config keeps jaxllm's default "
              f"data section (data.tokenizer={cfg.data.tokenizer}, data.input={cfg.data.input}); the data must be "
              f"tokenized as the model expects: import again with --config.data.* or edit {config_py}",
              file=sys.stderr)
    print(f"imported {hf_architecture(cfg.model).hf_class} from {directory} into "
          f"{workdir} (step 0, data.tokenizer={cfg.data.tokenizer})\n"
          f"train on:  python -m jaxllm.train --config={config_py} --workdir={workdir}\n"
          f"sample:    python -m jaxllm.generate --workdir={workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
