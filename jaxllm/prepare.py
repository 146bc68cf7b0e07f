"""Text -> a Megatron indexed dataset: ``PREFIX.bin`` + ``PREFIX.idx`` (+ ``PREFIX.meta.json``).

    python -m jaxllm.prepare --input PATH [PATH ...] --tokenizer {char,byte,gpt2,TOKENIZER.json,TOKENIZER.model,DIR} \\
        --output-prefix PREFIX [--gpt2-dir DIR] [--json-key text] [--document-marker MARKER] [--workers N]

The command line of :func:`jaxllm.data.text.prepare` (which documents the inputs, the output and the
crash-safe writing); a data error, or an output that cannot be written, is one line on stderr and exit status 2;
Ctrl-C one line and status 130, SIGTERM 143, the partial files removed (:func:`jaxllm.cli.stoppable`).
"""

from __future__ import annotations

import argparse
import sys

from jaxllm import cli
from jaxllm.data.text import MAX_UNDECODABLE, prepare


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv`` (default ``sys.argv[1:]``) and prepares; returns 0 (a DataError exits with status 2)."""
    p = argparse.ArgumentParser(prog="python -m jaxllm.prepare", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="text, JSON Lines or Parquet files and/or directories")
    p.add_argument("--tokenizer", required=True, metavar="{char,byte,gpt2,PATH}",
                   help="char, byte, gpt2, or a Hugging Face tokenizer.json / SentencePiece tokenizer.model / "
                        "directory holding one")
    p.add_argument("--output-prefix", required=True, metavar="PREFIX", help="writes PREFIX.bin, .idx, .meta.json")
    p.add_argument("--gpt2-dir", default="", metavar="DIR",
                   help="directory with GPT-2's encoder.json and vocab.bpe (default: the files shipped with jaxllm)")
    p.add_argument("--json-key", default="text", help="key (JSON Lines) or column (Parquet) holding the text")
    p.add_argument("--document-marker", default="", metavar="MARKER",
                   help="in text files, a line starting with MARKER begins a new document (and is dropped)")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    p.add_argument("--max-undecodable", type=float, default=MAX_UNDECODABLE, metavar="FRACTION",
                   help="the largest fraction of an input's characters that may fail to decode as UTF-8 (binary "
                        "files); 1 keeps anything")
    args = p.parse_args(argv)
    kept = f"nothing written to {args.output_prefix} (the partial files removed)"
    with cli.stoppable("jaxllm.prepare", kept), cli.usage_errors():
        cli.check_output("--output-prefix", args.output_prefix, directory=False)
        prepare(args.input, args.tokenizer, args.output_prefix, gpt2_dir=args.gpt2_dir, json_key=args.json_key,
                document_marker=args.document_marker, workers=args.workers, max_undecodable=args.max_undecodable)
    return 0


if __name__ == "__main__":
    sys.exit(main())
