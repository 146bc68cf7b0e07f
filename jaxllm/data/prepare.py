"""Text files -> a prepared directory: ``tokens.bin`` (flat token ids) + ``meta.json``.

    python -m jaxllm.data.prepare --input PATH [PATH ...] --tokenizer {char,byte,gpt2} --output DIR \
        [--gpt2-dir DIR] [--val-fraction 0.1]

Layout of a prepared directory:
  tokens.bin  the whole token stream, native-endian uint16 (vocab <= 65536) or uint32, no header:
              ``np.memmap(path, dtype=meta["dtype"], mode="r")``. The first ``train_tokens`` are
              the train split, the last ``val_tokens`` the validation split.
  meta.json   format_version, tokenizer, vocab_size, eot_id, dtype, num_tokens, train_tokens,
              val_tokens, val_fraction, sources [{path, bytes, sha256}], and the tokenizer's own
              fields (char: chars; gpt2: gpt2_dir, gpt2_sha256 {encoder.json, vocab.bpe}).

Inputs: a file is taken as given; a directory is walked recursively in sorted order taking
files ending in .py .txt .md .rst, skipping hidden files and directories, ``__pycache__``,
``site-packages`` and ``dist-packages``. A file listed twice is read once. Bytes that are not
valid UTF-8 are decoded with errors="replace" (U+FFFD), so such files are kept, not skipped
(the stdlib has a few latin-1 test files).

Documents (files) are joined with "\\n" for char/byte (a single file's tokens are exactly the
file's) and with the end-of-text token after every document for gpt2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
import uuid

import numpy as np

from jaxllm.data.tokenizers import (ByteTokenizer, CharTokenizer, DataError, GPT2Tokenizer, GPT2_FILES,
                                    sha256_file)

FORMAT_VERSION = 1
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
TOKENS, META = "tokens.bin", "meta.json"
# Characters per encode_batch call for gpt2: bounds memory while keeping both cores busy.
_GPT2_BATCH_CHARS = 8 << 20


def collect_files(inputs: list[str]) -> list[str]:
    """Absolute paths of the text files ``inputs`` name, in corpus order (see the module doc).

    Raises:
      DataError: an input does not exist, or no text file was found.
    """
    files, seen = [], set()

    def add(path):
        if path not in seen:
            seen.add(path)
            files.append(path)

    for inp in inputs:
        path = os.path.abspath(inp)
        if os.path.isdir(path):
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
                for n in sorted(names):
                    if n.endswith(TEXT_SUFFIXES) and not n.startswith("."):
                        add(os.path.join(root, n))
        elif os.path.exists(path):
            add(path)
        else:
            raise DataError(f"data input {inp}: no such file or directory; set data.input (--input) to text "
                            f"files or directories")
    if not files:
        raise DataError(f"data input {', '.join(inputs)}: no text files ({' '.join(TEXT_SUFFIXES)}) found; "
                        f"point data.input (--input) at text files or directories holding them")
    return files


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise DataError(f"data input {path}: cannot read it ({e.strerror or e}); fix or remove the file, "
                        f"or leave it out of data.input (--input)") from None


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def _make_tokenizer(name: str, files: list[str], gpt2_dir: str):
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        if not gpt2_dir:
            raise DataError("tokenizer gpt2 needs data.gpt2_dir (--gpt2-dir): the directory holding GPT-2's "
                            "encoder.json and vocab.bpe")
        return GPT2Tokenizer(gpt2_dir)
    if name == "char":
        # A first pass over the corpus: the vocabulary must exist before any id is written.
        chars = set("\n") if len(files) > 1 else set()
        for path in files:
            chars.update(_text(_read(path)))
        if not chars:
            raise DataError(f"data input: the {len(files)} file(s) are empty; nothing to tokenize")
        return CharTokenizer("".join(sorted(chars)))
    raise DataError(f"data.tokenizer={name!r}: choose one of char, byte, gpt2")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_replaceable(path: str) -> bool:
    """Only an earlier prepared directory or an empty one may be replaced: never a user's other files."""
    return os.path.isdir(path) and (not os.listdir(path) or os.path.isfile(os.path.join(path, META)))


def _same_data(output: str, sources: list[dict]) -> bool:
    """Whether ``output`` is a sound prepared directory of exactly these sources."""
    from jaxllm.data.loader import TokenData

    try:
        return TokenData(output).meta["sources"] == sources
    except DataError:
        return False


def _publish(tmp: str, output: str, sources: list[dict], keep_existing: bool) -> bool:
    """Renames the finished ``tmp`` to ``output``. Returns False (and removes tmp) when
    ``keep_existing`` and ``output`` already holds the same data, e.g. another process won a race."""
    try:
        os.rename(tmp, output)
        return True
    except OSError:
        if not os.path.exists(output):
            raise
    if keep_existing and _same_data(output, sources):
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    if not _is_replaceable(output):
        raise DataError(f"prepare output {output}: exists and is not a prepared directory; choose another "
                        f"--output or remove it")
    # A directory cannot be replaced in one atomic step: move the old one aside first, so
    # OUTPUT is at every moment either the old complete data, absent, or the new complete data.
    old = os.path.join(os.path.dirname(output), f".{os.path.basename(output)}.old-{uuid.uuid4().hex[:8]}")
    os.rename(output, old)
    os.rename(tmp, output)
    shutil.rmtree(old, ignore_errors=True)
    return True


def _prepare(files: list[str], tokenizer: str, output: str, gpt2_dir: str, val_fraction: float,
             keep_existing: bool = False) -> dict:
    t0 = time.perf_counter()
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"data.val_fraction (--val-fraction)={val_fraction}: must be in (0, 1)")
    output = os.path.abspath(output)
    if os.path.exists(output) and not _is_replaceable(output):
        raise DataError(f"prepare output {output}: exists and is not a prepared directory; choose another "
                        f"--output or remove it")
    tok = _make_tokenizer(tokenizer, files, gpt2_dir)
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 65536 else np.uint32)
    parent = os.path.dirname(output)
    os.makedirs(parent, exist_ok=True)
    # Hidden, beside the output (same filesystem, so the final rename is atomic), and skipped
    # by collect_files should the output lie inside an input directory.
    tmp = os.path.join(parent, f".{os.path.basename(output)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)
    try:
        sources, num_tokens = [], 0
        with open(os.path.join(tmp, TOKENS), "wb") as out:
            def write(ids):
                nonlocal num_tokens
                out.write(np.asarray(ids).astype(dtype, copy=False).tobytes())
                num_tokens += len(ids)

            def source(path, raw):
                sources.append({"path": path, "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()})
                return _text(raw)

            if isinstance(tok, GPT2Tokenizer):
                eot = np.array([tok.eot_id], np.int32)
                batch, size = [], 0
                for i, path in enumerate(files):
                    text = source(path, _read(path))
                    batch.append(text)
                    size += len(text)
                    if size >= _GPT2_BATCH_CHARS or i == len(files) - 1:
                        for ids in tok.encode_batch(batch):
                            write(ids)
                            write(eot)
                        batch, size = [], 0
            else:
                sep = tok.encode("\n")
                for i, path in enumerate(files):
                    if i:
                        write(sep)
                    write(tok.encode(source(path, _read(path))))
            out.flush()
            os.fsync(out.fileno())

        train_tokens = int(num_tokens * (1.0 - val_fraction))  # nanoGPT: data[:int(n * 0.9)]
        val_tokens = num_tokens - train_tokens
        if train_tokens == 0 or val_tokens == 0:
            raise DataError(f"data input: only {num_tokens} tokens, so with val_fraction={val_fraction} the "
                            f"{'train' if not train_tokens else 'val'} split would be empty; use more text")
        meta = {
            "format_version": FORMAT_VERSION,
            "tokenizer": tok.name,
            "vocab_size": int(tok.vocab_size),
            "eot_id": tok.eot_id,
            "dtype": dtype.name,
            "num_tokens": num_tokens,
            "train_tokens": train_tokens,
            "val_tokens": val_tokens,
            "val_fraction": val_fraction,
            "sources": sources,
            **tok.meta_fields(),
        }
        with open(os.path.join(tmp, META), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1, ensure_ascii=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        published = _publish(tmp, output, sources, keep_existing)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not published:
        with open(os.path.join(output, META), encoding="utf-8") as f:
            return json.load(f)
    mb = sum(s["bytes"] for s in sources) / 1e6
    print(f"prepare: {num_tokens:,} {tok.name} tokens (train {train_tokens:,}, val {val_tokens:,}) from "
          f"{len(files):,} files ({mb:.1f} MB) in {time.perf_counter() - t0:.1f}s -> {output}", file=sys.stderr, flush=True)
    return meta


def prepare(inputs: list[str], tokenizer: str, output: str, *, gpt2_dir: str = "", val_fraction: float = 0.1) -> dict:
    """Tokenizes text files/directories into ``output/tokens.bin`` + ``output/meta.json``.

    Writes into a hidden temporary directory beside ``output``, fsyncs, then renames it into
    place: ``output`` never holds half-written data, and on any error nothing is left behind.
    An existing ``output`` is replaced only if it is a prepared directory or empty.

    Args:
      inputs: text files and/or directories (see the module doc for what is taken).
      tokenizer: "char", "byte" or "gpt2".
      output: the directory to create.
      gpt2_dir: directory with GPT-2's encoder.json and vocab.bpe (tokenizer="gpt2").
      val_fraction: the last this fraction of the token stream is the validation split.
    Returns:
      the meta dict written to meta.json.
    Raises:
      DataError: a missing/unreadable input, no text, a bad tokenizer or val_fraction, too few
        tokens for both splits, or an ``output`` that holds other files.
    """
    return _prepare(collect_files(list(inputs)), tokenizer, output, gpt2_dir, val_fraction)


def _inputs(data_cfg) -> list[str]:
    inp = data_cfg.input
    return [p for p in inp.split(",") if p] if isinstance(inp, str) else list(inp)


def ensure_prepared(data_cfg, cache_root: str) -> str:
    """The prepared directory for the ``data`` config section, preparing it only when needed.

    If ``data_cfg.input`` is one directory holding meta.json it is used as-is (after checking
    it opens); its own tokenizer wins over ``data_cfg.tokenizer``. Otherwise the inputs are
    prepared into ``cache_root/<key>``, where the key hashes the tokenizer, val_fraction, the
    gpt2 files' checksums and the sources (path + sha256, in corpus order, which decides the
    split); an existing complete directory with that key is reused untouched. Processes racing
    on the same key are safe: the first to finish wins and the others use its result.

    Args:
      data_cfg: the config's ``data`` section (input, tokenizer, gpt2_dir, val_fraction).
      cache_root: directory for prepared caches (created if missing).
    Returns:
      the prepared directory's path.
    Raises:
      DataError: as ``prepare``, or the prepared directory is broken (see TokenData).
    """
    from jaxllm.data.loader import TokenData

    inputs = _inputs(data_cfg)
    if len(inputs) == 1 and os.path.isfile(os.path.join(inputs[0], META)):
        directory = os.path.abspath(inputs[0])
        data = TokenData(directory)
        if data.meta["tokenizer"] != data_cfg.tokenizer:
            print(f"prepare: using {directory} as prepared, with its tokenizer {data.meta['tokenizer']!r} "
                  f"(data.tokenizer={data_cfg.tokenizer!r} is ignored)", file=sys.stderr, flush=True)
        return directory

    files = collect_files(inputs)
    sources = [[p, sha256_file(p)] for p in files]
    gpt2_sha = None
    if data_cfg.tokenizer == "gpt2":
        if not data_cfg.gpt2_dir:
            raise DataError("data.tokenizer=gpt2 needs data.gpt2_dir: the directory holding GPT-2's encoder.json "
                            "and vocab.bpe")
        gpt2_sha = [sha256_file(os.path.join(data_cfg.gpt2_dir, n)) if os.path.isfile(
            os.path.join(data_cfg.gpt2_dir, n)) else None for n in GPT2_FILES]
    key_src = json.dumps([FORMAT_VERSION, data_cfg.tokenizer, float(data_cfg.val_fraction), gpt2_sha, sources])
    key = f"{data_cfg.tokenizer}-{hashlib.sha256(key_src.encode()).hexdigest()[:16]}"
    directory = os.path.join(os.path.abspath(cache_root), key)
    if os.path.isfile(os.path.join(directory, META)):
        try:
            meta = TokenData(directory).meta
            if [[s["path"], s["sha256"]] for s in meta["sources"]] == sources:
                print(f"prepare: reusing {directory} ({meta['num_tokens']:,} {meta['tokenizer']} tokens)", file=sys.stderr, flush=True)
                return directory
        except DataError as e:
            print(f"prepare: preparing again: {e}", file=sys.stderr, flush=True)
    _prepare(files, data_cfg.tokenizer, directory, data_cfg.gpt2_dir, float(data_cfg.val_fraction),
             keep_existing=True)
    return directory


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxllm.data.prepare", description=__doc__.split("\n")[0])
    p.add_argument("--input", nargs="+", required=True, metavar="PATH", help="text files and/or directories")
    p.add_argument("--tokenizer", required=True, choices=("char", "byte", "gpt2"))
    p.add_argument("--output", required=True, metavar="DIR", help="the prepared directory to write")
    p.add_argument("--gpt2-dir", default="", metavar="DIR", help="directory with encoder.json and vocab.bpe")
    p.add_argument("--val-fraction", type=float, default=0.1, help="last fraction of tokens kept for validation")
    args = p.parse_args(argv)
    try:
        prepare(args.input, args.tokenizer, args.output, gpt2_dir=args.gpt2_dir, val_fraction=args.val_fraction)
    except DataError as e:
        print(f"data error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
