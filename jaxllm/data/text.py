"""Text -> a Megatron indexed dataset: ``PREFIX.bin`` + ``PREFIX.idx`` (+ ``PREFIX.meta.json``).

What :mod:`jaxllm.prepare` (the command line) and :class:`jaxllm.data.loader.Data` (``data.input`` of
text, prepared once into the run's cache by :func:`ensure_prepared`) call.

The output is what Megatron-LM's ``tools/preprocess_data.py --append-eod`` writes (the format:
:mod:`jaxllm.data.indexed`), so Megatron reads it too; unlike Megatron's tool, the files are
exactly ``PREFIX.bin`` and ``PREFIX.idx`` (no ``_text_document`` is appended). One document per:

* text file (``.py .txt .md .rst``, or any file named explicitly) -- or, with
  ``--document-marker M``, per part of it: a line starting with ``M`` begins a new document
  and is itself dropped (e.g. ``--document-marker '<|file|>'`` for a file whose documents each
  begin with a line ``<|file|> NAME``);
* line of a JSON Lines file (``.jsonl``, or ``.json`` named explicitly: Megatron's "loose
  json"), its text at ``--json-key`` (default ``text``);
* row of a Parquet file (``.parquet``; needs ``pip install pyarrow``), column ``--json-key``.

Directories are walked recursively in sorted order for those suffixes (``.json`` only when
named), skipping hidden files and directories, ``__pycache__``, ``site-packages`` and
``dist-packages``; a file listed twice is read once; bytes that are not UTF-8 become U+FFFD, with one
line saying how many and how to re-encode the file (more than ``--max-undecodable`` of an input stop).
The tokenizer's end-of-document token (gpt2: ``<|endoftext|>``; a Hugging Face tokenizer: its
``eos_token``; a SentencePiece model: its end-of-sentence piece) is appended to every document; char
and byte have none, so their documents follow one another directly. Empty documents are skipped.

``PREFIX.meta.json`` records what jaxllm needs beyond Megatron's files: the tokenizer (to
decode, and its vocabulary), the documents' UTF-8 bytes (bits per byte) and the sources.
Writing is crash-safe: the three files are written under temporary names beside PREFIX,
fsynced, and renamed into place with ``PREFIX.idx`` last (an old ``PREFIX.idx`` is removed
first), so PREFIX is at every moment the old complete dataset, absent, or the new complete one.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import multiprocessing
import os
import shlex
import sys
import time
import uuid

import numpy as np

from jaxllm.config import Data, default_corpus
from jaxllm.data import cache, indexed
from jaxllm.data.tokenizers import (
    GPT2_FILES,
    TOKENIZER_NAMES,
    CharTokenizer,
    gpt2_dir_or_packaged,
    make_tokenizer,
    sha256_file,
    tokenizer_from_meta,
)
from jaxllm.errors import DataError

FORMAT_VERSION = 2
META_SUFFIX = ".meta.json"
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
RECORD_SUFFIXES = (".jsonl", ".parquet")
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
# Characters handed to the tokenizer at once: bounds memory, keeps the workers (or Rust threads) busy.
_BATCH_CHARS = 4 << 20


# The largest fraction of an input's characters that may fail to decode as UTF-8 (or be NUL), as
# data.max_undecodable: the standard library's sources hold a few test files in other encodings
# (0.01% of the corpus); an executable is about 27%.
MAX_UNDECODABLE = Data.__dataclass_fields__["max_undecodable"].default


def meta_path(prefix: str) -> str:
    return prefix + META_SUFFIX


def read_meta(prefix: str) -> dict | None:
    """The parsed ``PREFIX.meta.json``, or None when there is none (e.g. data from Megatron's tool).

    Raises:
      DataError: it exists but is not a JSON object of this format.
    """
    path = meta_path(prefix)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (ValueError, OSError) as e:
        raise DataError(f"{path}: unreadable ({e}); prepare the data again (python -m jaxllm.prepare)") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        raise DataError(f"{path}: format_version {version!r}, this version reads {FORMAT_VERSION}; prepare the data "
                        f"again (python -m jaxllm.prepare)")
    return meta


def collect_files(inputs: list[str]) -> list[str]:
    """Absolute paths of the files ``inputs`` name, in corpus order (see the module doc).

    Raises:
      DataError: an input does not exist, or no file was found.
    """
    files, seen = [], set()
    suffixes = TEXT_SUFFIXES + RECORD_SUFFIXES
    for inp in inputs:
        path = os.path.abspath(inp)
        if os.path.isdir(path):
            found = []
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
                found += [os.path.join(root, n) for n in sorted(names)
                          if n.endswith(suffixes) and not n.startswith(".")]
        elif os.path.exists(path):
            found = [path]
        else:
            raise DataError(f"data input {inp}: no such file or directory; set data.input (--input) to text, JSON "
                            f"Lines or Parquet files or directories")
        for f in found:
            if f not in seen:
                seen.add(f)
                files.append(f)
    if not files:
        raise DataError(f"data input {', '.join(inputs)}: no files ({' '.join(suffixes)}) found; point data.input "
                        f"(--input) at text files or directories holding them")
    return files


def _cannot_read(path, e):
    return DataError(f"data input {path}: cannot read it ({getattr(e, 'strerror', None) or e}); fix or remove the "
                     f"file, or leave it out of data.input (--input)")


def _lines(path: str):
    try:
        with open(path, "rb") as f:
            yield from f
    except OSError as e:
        raise _cannot_read(path, e) from None


def iter_documents(path: str, json_key: str = "text", document_marker: str = ""):
    """Yields ``(text, source_bytes)`` for each document of one file (see the module doc);
    ``source_bytes`` are the file's bytes consumed since the previous document (progress).

    Raises:
      DataError: unreadable file, a JSON Lines line that is not an object with a string at
        ``json_key``, a Parquet file without that column, or Parquet without pyarrow.
    """
    if path.endswith((".jsonl", ".json")):
        consumed = 0
        for n, line in enumerate(_lines(path), 1):
            consumed += len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path}:{n}: not JSON ({e}); a JSON Lines file holds one JSON object per "
                                f"line") from None
            text = record.get(json_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                keys = list(record) if isinstance(record, dict) else type(record).__name__
                raise DataError(f"{path}:{n}: no string at key {json_key!r} (has {keys}); set --json-key "
                                f"(data.json_key) to the key holding the text")
            yield text, consumed
            consumed = 0
    elif path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading Parquet needs pyarrow, which is not installed: pip install pyarrow "
                            f"(or convert the file to JSON Lines)") from None
        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises its own exception types
            raise _cannot_read(path, e) from None
        if json_key not in pf.schema_arrow.names:
            raise DataError(f"{path}: no column {json_key!r} (has {pf.schema_arrow.names}); set --json-key "
                            f"(data.json_key) to the column holding the text")
        per_row = os.path.getsize(path) / max(1, pf.metadata.num_rows)
        for batch in pf.iter_batches(columns=[json_key]):
            for text in batch.column(0).to_pylist():
                if text is not None:
                    yield text, per_row
    elif document_marker:
        marker = document_marker.encode("utf-8")
        parts, consumed = [], 0
        for line in _lines(path):
            consumed += len(line)
            if line.startswith(marker):
                if parts:
                    yield b"".join(parts).decode("utf-8", errors="replace"), consumed
                    consumed = 0
                parts = []
            else:
                parts.append(line)
        if parts or consumed:
            yield b"".join(parts).decode("utf-8", errors="replace"), consumed
    else:
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise _cannot_read(path, e) from None
        yield raw.decode("utf-8", errors="replace"), len(raw)


def _inputs_of(inputs: list[str]) -> dict[str, str]:
    """Each file of ``inputs`` -> the input (file or directory) that names it."""
    return {f: item for item in reversed(inputs) for f in collect_files([item])}


def _reencode_hint(path: str) -> str:
    """How to re-encode ``path`` to UTF-8 (Latin-1 as the example: the commonest other encoding of text)."""
    return f"e.g. from Latin-1: iconv -f latin1 -t utf-8 {shlex.quote(path)} > {shlex.quote(path + '.utf8')}"


def _check_decodable(item: str, counts: dict, limit: float) -> None:
    """Stops at an input whose characters are more than ``limit`` not UTF-8 text (U+FFFD read for bytes that
    do not decode, or NUL), and says in one line how many characters of any other input became U+FFFD: text
    in another encoding is never changed without a word."""
    replaced, chars, files = counts["replaced"], counts["chars"], counts["files"]
    bad = replaced + counts["nul"]
    if chars and bad / chars > limit:
        raise DataError(f"data input {item}: {bad / chars:.1%} of its {chars:,} characters are not UTF-8 text "
                        f"(bytes that do not decode, or NUL): is it a binary file, or text in another encoding? "
                        f"Leave it out of data.input (--input), re-encode it to UTF-8"
                        f"{f' ({_reencode_hint(files[0])})' if files else ''}, or set data.max_undecodable "
                        f"(--max-undecodable) to {bad / chars:.2g} or more to keep it as read")
    if replaced and os.path.abspath(item) == os.path.abspath(default_corpus()):
        # the standard library's own tests of other encodings (test_source_encoding.py...): nothing to re-encode
        print(f"prepare: the default corpus (this Python's standard library) holds {replaced:,} bytes that do not "
              f"decode as UTF-8 (its tests of other encodings), read as U+FFFD", file=sys.stderr, flush=True)
    elif replaced:
        where = "" if files == [os.path.abspath(item)] else f" (in {files[0]}" + (
            f" and {len(files) - 1} more files)" if len(files) > 1 else ")")
        print(f"prepare: data input {item}: {replaced:,} of its {chars:,} characters{where} are bytes that do not "
              f"decode as UTF-8, read as U+FFFD; if it is text in another encoding, re-encode it to UTF-8 first "
              f"({_reencode_hint(files[0])})", file=sys.stderr, flush=True)


def _batches(files, json_key, document_marker, inputs_of=None, max_undecodable=1.0):
    """Lists of (text, source_bytes) of about _BATCH_CHARS characters, in corpus order.

    Checks on the way each input (a file, or all the files of a directory; ``inputs_of`` maps a file to
    its input) with :func:`_check_decodable`: a binary file (an executable, an archive) would otherwise
    train silently, and text in another encoding lose its accented letters silently.
    """
    batch, size, counts, current = [], 0, None, None
    for path in files:
        item = (inputs_of or {}).get(path, path)
        if item != current:
            if current is not None:
                _check_decodable(current, counts, max_undecodable)
            counts, current = {"replaced": 0, "nul": 0, "chars": 0, "files": []}, item
        for text, consumed in iter_documents(path, json_key, document_marker):
            replaced = text.count("\ufffd")
            if replaced and counts["files"][-1:] != [path]:  # an input's files come one after another
                counts["files"].append(path)
            counts["replaced"] += replaced
            counts["nul"] += text.count("\0")
            counts["chars"] += len(text)
            batch.append((text, consumed))
            size += len(text)
            if size >= _BATCH_CHARS:
                yield batch
                batch, size = [], 0
    if current is not None:
        _check_decodable(current, counts, max_undecodable)
    if batch:
        yield batch


_worker_tok = None


def _init_worker(tok_meta: dict) -> None:
    global _worker_tok
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # parallel across processes, not threads in each
    _worker_tok = tokenizer_from_meta(tok_meta)


def _encode(texts: list[str], tok=None) -> list[np.ndarray]:
    tok = tok or _worker_tok
    out = tok.encode_batch(texts)
    if tok.eot_id is not None:
        out = [np.append(ids, np.int32(tok.eot_id)) for ids in out]
    return out


def _fit_char(files, json_key, document_marker) -> CharTokenizer:
    chars = set()
    for path in files:
        for text, _ in iter_documents(path, json_key, document_marker):
            chars.update(text)
    if not chars:
        raise DataError(f"data input: the {len(files)} file(s) hold no text; nothing to tokenize")
    return CharTokenizer("".join(sorted(chars)))


def _replaceable(prefix: str) -> bool:
    """Only a dataset this tool wrote (it has PREFIX.meta.json), or nothing, may be replaced."""
    return os.path.isfile(meta_path(prefix)) or not indexed.exists(prefix)


def _checked_tokenizer(files, tokenizer: str, prefix: str, gpt2_dir: str, json_key: str, document_marker: str,
                       workers: int):
    """The tokenizer for ``files`` (char: fitted to them) once ``prefix`` may be written and ``workers`` is
    valid; DataError otherwise."""
    if not _replaceable(prefix):
        raise DataError(f"--output-prefix {prefix}: {prefix}.bin/.idx exist and were not written by "
                        f"jaxllm.prepare (no {META_SUFFIX}); choose another prefix or remove them")
    if workers < 1:
        raise DataError(f"--workers={workers}: must be >= 1")
    return _fit_char(files, json_key, document_marker) if tokenizer == "char" else make_tokenizer(tokenizer, gpt2_dir)


@contextlib.contextmanager
def _encoded(batches, tok, tok_meta: dict, workers: int):
    """``(batch, token ids per text)`` for each of ``batches``, in order: encoded in this process (1 worker)
    or by ``workers`` spawned processes (terminated at the exit of the ``with``)."""
    if workers == 1:
        yield ((b, _encode([t for t, _ in b], tok)) for b in batches)
        return
    pool = multiprocessing.get_context("spawn").Pool(workers, _init_worker, (tok_meta,))
    pairs = collections.deque()  # the batches in flight, in order

    def texts_of(batch):
        pairs.append(batch)
        return [t for t, _ in batch]

    try:
        yield ((pairs.popleft(), ids) for ids in pool.imap(_encode, (texts_of(b) for b in batches)))
    finally:
        pool.terminate()


def _write_documents(encoded, writer, tok, tokenizer: str, bar) -> tuple[int, int]:
    """Adds each non-empty document of ``encoded`` (:func:`_encoded`) to ``writer``; returns the tokens and
    UTF-8 bytes of text written.  DataError on an id outside ``tok``'s vocabulary."""
    num_tokens = text_bytes = 0
    for batch, ids_list in encoded:
        for (text, _), ids in zip(batch, ids_list):
            if not text:
                continue  # an empty document (Megatron's tool writes no sequence for one either)
            if len(ids) and int(ids.max()) >= tok.vocab_size:
                raise DataError(f"tokenizer {tokenizer}: produced id {int(ids.max())} >= its vocabulary size "
                                f"{tok.vocab_size}; the tokenizer files are inconsistent")
            writer.add_document(ids)
            num_tokens += len(ids)
            text_bytes += len(text.encode("utf-8"))
        bar.update(sum(c for _, c in batch))
    return num_tokens, text_bytes


def _commit(names: dict[str, str], prefix: str) -> None:
    """Writes the temporary files ``names`` (suffix -> path, fsynced) over ``prefix``'s, ``PREFIX.idx``
    the last to appear (IndexedDataset needs both halves)."""
    try:
        os.unlink(indexed.idx_path(prefix))
    except FileNotFoundError:
        pass
    os.replace(names[".bin"], indexed.bin_path(prefix))
    os.replace(names[META_SUFFIX], meta_path(prefix))
    os.replace(names[".idx"], indexed.idx_path(prefix))
    cache.fsync_dir(os.path.dirname(prefix))


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _prepare(files: list[str], tokenizer: str, prefix: str, *, gpt2_dir: str = "", json_key: str = "text",
             document_marker: str = "", workers: int = 1, progress: bool = True, inputs_of=None,
             max_undecodable: float = 1.0) -> dict:
    """:func:`prepare` of the files ``files`` (``inputs_of``: file -> the input that named it)."""
    t0 = time.perf_counter()
    prefix = os.path.abspath(prefix)
    tok = _checked_tokenizer(files, tokenizer, prefix, gpt2_dir, json_key, document_marker, workers)
    dtype = indexed.token_dtype(tok.vocab_size)
    tok_meta = {"tokenizer": tok.name, **tok.meta_fields()}
    parent = os.path.dirname(prefix)
    made, d = [], parent  # the folders this call creates, deepest first: removed again if it fails
    while not os.path.exists(d):
        made.append(d)
        d = os.path.dirname(d)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(prefix)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    names = {s: tmp + s for s in (".bin", ".idx", META_SUFFIX)}
    from tqdm import tqdm

    total = sum(os.path.getsize(f) for f in files if os.path.isfile(f))  # an unreadable one fails when read
    writer = bar = None
    try:  # from the first file written on: whatever stops it (Ctrl-C too) leaves nothing behind
        writer = indexed.IndexedWriter(names[".bin"], names[".idx"], dtype)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=None if progress else True,
                   file=sys.stderr)
        batches = _batches(files, json_key, document_marker, inputs_of, max_undecodable)
        with _encoded(batches, tok, tok_meta, workers) as encoded:
            num_tokens, text_bytes = _write_documents(encoded, writer, tok, tokenizer, bar)
        bar.close()
        if not writer.lengths:
            shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
            raise DataError(f"data input {shown}: no document with any text in it (empty, or only blank lines "
                            "and document markers); give a corpus that holds text (--input, data.input)")
        writer.finish()
        meta = {
            "format_version": FORMAT_VERSION,
            **tok_meta,
            "vocab_size": int(tok.vocab_size),
            "eot_id": tok.eot_id,
            "dtype": dtype.name,
            "num_documents": len(writer.lengths),
            "num_tokens": num_tokens,
            "text_bytes": text_bytes,
            "json_key": json_key,
            "document_marker": document_marker,
            "sources": [{"path": f, "bytes": os.path.getsize(f), "sha256": sha256_file(f)} for f in files],
        }
        _write_json(names[META_SUFFIX], meta)
        _commit(names, prefix)
    except BaseException:
        if writer is not None:
            writer.abort()
        if bar is not None:
            bar.close()
        for n in names.values():
            try:
                os.unlink(n)
            except FileNotFoundError:
                pass
        for d in made:
            with contextlib.suppress(OSError):  # only if empty: another process may have written there meanwhile
                os.rmdir(d)
        raise
    dt = time.perf_counter() - t0
    mb = text_bytes / 1e6
    print(f"prepare: {meta['num_documents']:,} documents, {num_tokens:,} {tok.name} tokens from {len(files):,} files "
          f"({mb:.1f} MB of text) in {dt:.1f} s ({mb / dt:.2f} MB/s, {num_tokens / dt:,.0f} tokens/s, "
          f"{workers} worker{'s' if workers > 1 else ''}) -> {prefix}.bin/.idx", file=sys.stderr, flush=True)
    return meta


def prepare(inputs: list[str], tokenizer: str, output_prefix: str, *, gpt2_dir: str = "", json_key: str = "text",
            document_marker: str = "", workers: int = 1, progress: bool = True,
            max_undecodable: float = MAX_UNDECODABLE) -> dict:
    """Tokenizes files/directories into the indexed dataset ``output_prefix`` (see the module doc).

    Args:
      inputs: text, JSON Lines or Parquet files and/or directories.
      tokenizer: "char", "byte", "gpt2", or a Hugging Face tokenizer.json, a SentencePiece tokenizer.model
        (or a directory holding one).
      output_prefix: writes ``output_prefix.bin``, ``.idx`` and ``.meta.json``.
      gpt2_dir: GPT-2's encoder.json + vocab.bpe (tokenizer "gpt2"); "": the files shipped with jaxllm.
      json_key: the text's key in JSON Lines records / column in Parquet files.
      document_marker: in text files, a line starting with it begins a new document ("": one per file).
      workers: tokenizing processes (1: this process, with the tokenizer's own threads).
      progress: draw a progress bar on a terminal.
      max_undecodable: the largest fraction of an input's characters that may fail to decode as
        UTF-8 or be NUL (a binary file; 1.0 keeps anything).
    Returns:
      the metadata written to ``output_prefix.meta.json``.
    Raises:
      DataError: a missing/unreadable/malformed input, an input that is not text, no text, a bad
        tokenizer, or an existing dataset at ``output_prefix`` that this tool did not write.
    """
    inputs = list(inputs)
    return _prepare(collect_files(inputs), tokenizer, output_prefix, gpt2_dir=gpt2_dir, json_key=json_key,
                    document_marker=document_marker, workers=workers, progress=progress,
                    inputs_of=_inputs_of(inputs), max_undecodable=max_undecodable)


def text_inputs(data_cfg) -> list[str]:
    """``data.input`` as a list of text inputs (comma-separated)."""
    inp = data_cfg.input
    return [p for p in inp.split(",") if p] if isinstance(inp, str) else list(inp)


def ensure_prepared(data_cfg, cache_root: str, quiet: bool = False) -> str:
    """The prefix of the indexed dataset of ``data.input``'s text, preparing it only when needed.

    The text is prepared into ``cache_root/<key>/data.{bin,idx,meta.json}``, where the key hashes
    the tokenizer (and its files' checksums), ``data.json_key``, ``data.document_marker`` and the
    sources (path + sha256, in corpus order); an existing entry with that key is reused
    untouched. Of several processes (one per node, or all) one prepares while the others wait
    (:func:`jaxllm.data.cache.build_once`).

    Args:
      data_cfg: the config's ``data`` section (input, tokenizer, gpt2_dir, json_key, document_marker).
      cache_root: directory for prepared caches (created if missing).
      quiet: no line saying an entry is reused (a multi-process run's processes other than 0).
    Returns:
      the prefix (``.../data``).
    Raises:
      DataError: as :func:`prepare`.
    """
    files = collect_files(text_inputs(data_cfg))
    sources = [[p, sha256_file(p)] for p in files]
    spec = name = data_cfg.tokenizer
    if spec == "gpt2":
        gpt2_dir = gpt2_dir_or_packaged(data_cfg.gpt2_dir)
        tok_key = [sha256_file(os.path.join(gpt2_dir, n)) if os.path.isfile(
            os.path.join(gpt2_dir, n)) else None for n in GPT2_FILES]
    elif spec in TOKENIZER_NAMES:
        tok_key = spec
    else:
        tok = make_tokenizer(spec)
        tok_key, name = tok.sha256, tok.name
    key_src = json.dumps([FORMAT_VERSION, name, tok_key, data_cfg.json_key, data_cfg.document_marker, sources])
    directory = os.path.join(os.path.abspath(cache_root), f"{name}-{hashlib.sha256(key_src.encode()).hexdigest()[:16]}")
    prefix = os.path.join(directory, "data")

    def build(tmp):
        _prepare(files, spec, os.path.join(tmp, "data"), gpt2_dir=data_cfg.gpt2_dir, json_key=data_cfg.json_key,
                 document_marker=data_cfg.document_marker, inputs_of=_inputs_of(text_inputs(data_cfg)),
                 max_undecodable=data_cfg.max_undecodable)

    built = cache.build_once(directory, build, what=f"the tokenized {', '.join(text_inputs(data_cfg))[:200]}")
    if not built and not quiet:
        meta = read_meta(prefix)
        print(f"prepare: reusing {prefix} ({meta['num_tokens']:,} {meta['tokenizer']} tokens, "
              f"{meta['num_documents']:,} documents)", flush=True)  # progress, not a problem: stdout
    return prefix
