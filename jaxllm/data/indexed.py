"""Megatron-LM indexed datasets: ``PREFIX.bin`` (the tokens) + ``PREFIX.idx`` (where they are).

The layout is Megatron-LM's (``megatron/core/datasets/indexed_dataset.py``), so data written
by its ``tools/preprocess_data.py`` is read here and data written here is read by Megatron.
``PREFIX.idx``, all little-endian::

    magic             9 bytes   b"MMIDIDX\\x00\\x00"
    version           uint64    1
    dtype code        uint8     the token dtype of PREFIX.bin (see DTYPES)
    sequence count    uint64    S
    document count    uint64    D + 1
    sequence lengths  int32[S]  tokens per sequence
    sequence pointers int64[S]  byte offset of each sequence in PREFIX.bin
    document indices  int64[D+1] sequence index where each document starts, then S

``PREFIX.bin`` holds the tokens of every sequence, back to back, no header. GPT data has one
sequence per document (Megatron's GPTDataset samples sequences; a document split into
sentences is several). jaxllm's own ``prepare`` writes a third file, ``PREFIX.meta.json``
(:mod:`jaxllm.data.text`), that Megatron ignores.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from jaxllm.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8
# Megatron-LM's DType enum: code -> numpy dtype of the tokens.
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}


def token_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice for a vocabulary (``DType.optimal_dtype``): uint16 below 65,500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def exists(prefix: str) -> bool:
    """Whether either half of an indexed dataset is at ``prefix``."""
    return os.path.isfile(idx_path(prefix)) or os.path.isfile(bin_path(prefix))


class IndexedDataset:
    """One Megatron indexed dataset, memory-mapped read-only (numpy only: no torch, no pickle).

    Args:
      prefix: the path without ``.bin``/``.idx``.
      key: the config key or flag that named it, for error messages (e.g. ``data.input``).
    Attributes:
      prefix: the absolute prefix.
      dtype: numpy dtype of the tokens.
      sequence_lengths: int32 [S] memmap, tokens per sequence.
      sequence_pointers: int64 [S] memmap, byte offset of each sequence in the .bin.
      document_indices: int64 [D+1] memmap.
      tokens: memmap [total tokens] of ``dtype``: the whole .bin.
      num_tokens: total tokens (int).
    Raises:
      DataError: a missing half, a wrong magic or version, a dtype code Megatron does not
        define, an .idx shorter than its header says, lengths/pointers that disagree, or a
        .bin shorter or longer than the index says.
    """

    def __init__(self, prefix: str, key: str = "data.input"):
        self.prefix = prefix = os.path.abspath(prefix)
        self.key = key
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        have_idx, have_bin = os.path.isfile(ipath), os.path.isfile(bpath)
        if not (have_idx and have_bin):
            missing = ", ".join(p for p, ok in ((ipath, have_idx), (bpath, have_bin)) if not ok)
            raise DataError(f"{key}: indexed dataset {prefix}: {missing} not found; a Megatron indexed dataset is "
                            f"PREFIX.bin + PREFIX.idx (give the prefix without the suffix), written by "
                            f"python -m jaxllm.prepare or Megatron's tools/preprocess_data.py")
        redo = "write it again (python -m jaxllm.prepare or Megatron's tools/preprocess_data.py)"
        size = os.path.getsize(ipath)
        with open(ipath, "rb") as f:
            header = f.read(HEADER_BYTES)
        if header[:len(MAGIC)] != MAGIC:
            raise DataError(f"{ipath}: not a Megatron index (magic {header[:len(MAGIC)]!r}, expected {MAGIC!r}); "
                            f"{key} must name PREFIX of a PREFIX.idx written by Megatron's preprocess_data.py or "
                            f"jaxllm.prepare")
        if len(header) < HEADER_BYTES:
            raise DataError(f"{ipath}: truncated ({size} bytes, the header alone is {HEADER_BYTES}); {redo}")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", header[len(MAGIC):])
        if version != VERSION:
            raise DataError(f"{ipath}: index version {version}, this reader knows version {VERSION} (Megatron-LM's "
                            f"MMIDIDX); {redo}")
        if code not in DTYPES:
            raise DataError(f"{ipath}: token dtype code {code} is not one Megatron defines "
                            f"({', '.join(f'{k}={np.dtype(v).name}' for k, v in DTYPES.items())}); {redo}")
        want = HEADER_BYTES + n_seq * 4 + n_seq * 8 + n_doc * 8
        if size < want:
            raise DataError(f"{ipath}: truncated: {size} bytes, but its header says {n_seq:,} sequences and "
                            f"{max(n_doc - 1, 0):,} documents = {want:,} bytes; {redo}")
        if n_seq == 0 or n_doc == 0:
            raise DataError(f"{ipath}: holds no sequences (an empty dataset); {redo} from non-empty text, or leave it "
                            f"out of {key}")
        self.dtype = np.dtype(DTYPES[code])
        self.sequence_lengths = np.memmap(ipath, np.int32, "r", HEADER_BYTES, (n_seq,))
        self.sequence_pointers = np.memmap(ipath, np.int64, "r", HEADER_BYTES + 4 * n_seq, (n_seq,))
        self.document_indices = np.memmap(ipath, np.int64, "r", HEADER_BYTES + 12 * n_seq, (n_doc,))
        if self.document_indices[-1] != n_seq:
            raise DataError(f"{ipath}: document indices end at {self.document_indices[-1]}, not at the {n_seq:,} "
                            f"sequences; the index is corrupt: {redo}")
        itemsize = self.dtype.itemsize
        last = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * itemsize
        self.num_tokens = last // itemsize
        bsize = os.path.getsize(bpath)
        if bsize != last:
            what = "truncated" if bsize < last else "longer than its index says"
            raise DataError(f"{bpath}: {what}: {bsize:,} bytes, but {ipath} places its last sequence's end at byte "
                            f"{last:,} ({self.num_tokens:,} {self.dtype.name} tokens); the pair does not match: {redo}")
        self.tokens = np.memmap(bpath, self.dtype, "r", 0, (self.num_tokens,))

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def sequence(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``i`` (to its end if length is None): a
        read-only view [length] of ``dtype``."""
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        n = int(self.sequence_lengths[i]) - offset if length is None else length
        return self.tokens[start:start + n]

    def __repr__(self):
        return (f"IndexedDataset({self.prefix!r}: {self.num_documents:,} documents, {self.num_tokens:,} "
                f"{self.dtype.name} tokens)")


class IndexedWriter:
    """Writes one Megatron indexed dataset, one sequence per document, to ``bin_file``/``idx_file``.

    Usage: ``add_document(tokens)`` per document, then ``finish()`` (fsyncs both files).

    Args:
      bin_file, idx_file: paths of the files to create (the caller renames them into place).
      dtype: token dtype, one of DTYPES' (:func:`token_dtype` picks Megatron's).
    """

    def __init__(self, bin_file: str, idx_file: str, dtype):
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODES:
            raise ValueError(f"dtype {self.dtype}: not one of Megatron's token dtypes")
        self.idx_file = idx_file
        self._bin = open(bin_file, "wb")
        self.lengths: list[int] = []

    def add_document(self, tokens) -> None:
        """Appends one document (one sequence): any int array [n] whose ids fit ``dtype``."""
        arr = np.asarray(tokens)
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self.lengths.append(len(arr))

    def finish(self) -> None:
        """Writes the .idx and fsyncs both files."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.asarray(self.lengths, np.int32)
        pointers = np.zeros(len(lengths), np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(self.idx_file, "wb") as f:
            f.write(MAGIC + struct.pack("<QBQQ", VERSION, CODES[self.dtype], len(lengths), len(lengths) + 1))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(np.arange(len(lengths) + 1, dtype="<i8").tobytes())
            f.flush()
            os.fsync(f.fileno())

    def abort(self) -> None:
        self._bin.close()
