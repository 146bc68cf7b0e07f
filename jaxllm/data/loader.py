"""Reading a prepared directory (see ``jaxllm.data.prepare``) and drawing batches from it.

Batches are stateless: batch ``i`` is a pure function of ``(seed, i)``, so resuming from a
checkpoint at step ``i`` needs no loader state, and every process computes the same global
batch and reads only its own rows of it.
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np

from jaxllm.data.tokenizers import DataError, tokenizer_from_meta

TOKENS, META = "tokens.bin", "meta.json"
_DTYPES = ("uint16", "uint32")
_REDO = "delete it and run python -m jaxllm.data.prepare again (or point data.input at the text files)"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_meta(meta, path: str) -> None:
    def bad(problem):
        raise DataError(f"{path}: malformed meta.json ({problem}); {_REDO}")

    if not isinstance(meta, dict):
        bad("not a JSON object")
    if meta.get("format_version") != 1:
        bad(f"format_version {meta.get('format_version')!r}, this version reads 1")
    for key in ("vocab_size", "num_tokens", "train_tokens", "val_tokens"):
        if not _is_int(meta.get(key)) or meta[key] < 0:
            bad(f"{key} {meta.get(key)!r} is not a non-negative integer")
    if meta.get("tokenizer") not in ("char", "byte", "gpt2"):
        bad(f"tokenizer {meta.get('tokenizer')!r} is not char, byte or gpt2")
    if meta.get("dtype") not in _DTYPES:
        bad(f"dtype {meta.get('dtype')!r} is not one of {', '.join(_DTYPES)}")
    if meta["train_tokens"] + meta["val_tokens"] != meta["num_tokens"]:
        bad(f"train_tokens {meta['train_tokens']} + val_tokens {meta['val_tokens']} != num_tokens {meta['num_tokens']}")
    if meta["vocab_size"] > np.iinfo(meta["dtype"]).max + 1:
        bad(f"vocab_size {meta['vocab_size']} does not fit dtype {meta['dtype']}")
    if not isinstance(meta.get("sources"), list):
        bad("sources is not a list")


class TokenData:
    """A prepared directory, opened read-only: ``meta.json`` + ``tokens.bin`` as a memmap.

    Args:
      directory: a directory written by ``prepare``.
    Attributes:
      meta: the parsed meta.json.
      vocab_size: the tokenizer's vocabulary size.
      tokens: memmap [num_tokens] of dtype meta["dtype"] (uint16 or uint32): the whole stream.
      train: memmap view [train_tokens], the first part of ``tokens``.
      val: memmap view [val_tokens], the last part.
      tokenizer: the tokenizer (built on first use; gpt2 checks its files' checksums then).
    Raises:
      DataError: the directory, meta.json or tokens.bin is missing; meta.json is malformed;
        tokens.bin is empty, truncated or longer than meta.json says.
    """

    def __init__(self, directory: str):
        self.directory = directory = os.path.abspath(directory)
        if not os.path.isdir(directory):
            raise DataError(f"prepared data {directory}: no such directory; run python -m jaxllm.data.prepare "
                            f"--output {directory} ... or set data.input to text files or a prepared directory")
        meta_path, tokens_path = os.path.join(directory, META), os.path.join(directory, TOKENS)
        if not os.path.isfile(meta_path):
            raise DataError(f"{meta_path}: not found, so {directory} is not a prepared directory; "
                            f"run python -m jaxllm.data.prepare --output {directory} ...")
        try:
            with open(meta_path, encoding="utf-8") as f:
                meta = json.load(f)
        except (ValueError, OSError) as e:
            raise DataError(f"{meta_path}: malformed meta.json ({e}); {_REDO}") from None
        _check_meta(meta, meta_path)
        self.meta = meta
        self.vocab_size: int = meta["vocab_size"]
        if not os.path.isfile(tokens_path):
            raise DataError(f"{tokens_path}: not found; {_REDO}")
        itemsize = np.dtype(meta["dtype"]).itemsize
        size, want = os.path.getsize(tokens_path), meta["num_tokens"] * itemsize
        if size == 0 or want == 0:
            raise DataError(f"{tokens_path}: empty (file {size} bytes, meta.json says {meta['num_tokens']} "
                            f"tokens); {_REDO}")
        if size != want:
            what = "truncated" if size < want else "longer than meta.json says"
            raise DataError(f"{tokens_path}: {what}: {size} bytes, but meta.json says {meta['num_tokens']} "
                            f"{meta['dtype']} tokens = {want} bytes; {_REDO}")
        self.tokens = np.memmap(tokens_path, dtype=meta["dtype"], mode="r", shape=(meta["num_tokens"],))
        self.train = self.tokens[: meta["train_tokens"]]
        self.val = self.tokens[meta["train_tokens"]:]

    @functools.cached_property
    def tokenizer(self):
        return tokenizer_from_meta(self.meta)

    def check_vocab(self, model_vocab_size: int) -> None:
        """Raises DataError if ``model_vocab_size`` (model.vocab_size) cannot embed every token id."""
        if model_vocab_size < self.vocab_size:
            raise DataError(f"model.vocab_size={model_vocab_size} is smaller than the vocabulary of the data in "
                            f"{self.directory} ({self.vocab_size} {self.meta['tokenizer']} tokens); set "
                            f"model.vocab_size >= {self.vocab_size}, or 0 to derive it from the data")

    def unigram_entropy(self, split: str = "val") -> float:
        """Entropy of ``split``'s ("train", "val" or "all") token frequencies, nats/token.

        The cross-entropy that the best context-free model (a unigram distribution fitted to
        that very split) reaches on it: a language model's loss below it is what it learned
        from context. Reads the whole split: call it once. Raises ValueError for another split name.
        """
        tokens = {"train": self.train, "val": self.val, "all": self.tokens}.get(split)
        if tokens is None:
            raise ValueError(f"split={split!r}: choose train, val or all")
        counts = np.bincount(tokens, minlength=self.vocab_size)
        p = counts[counts > 0] / len(tokens)
        return float(-(p * np.log(p)).sum())

    def __repr__(self):
        m = self.meta
        return (f"TokenData({self.directory!r}: {m['tokenizer']} vocab {m['vocab_size']}, "
                f"train {m['train_tokens']:,} + val {m['val_tokens']:,} tokens)")


class Loader:
    """Step-indexed, stateless batches of windows drawn uniformly from a split.

    Batch ``i`` of the global batch is drawn by ``np.random.default_rng([seed, split, i])``
    (split 0 = train, 1 = val): ``global_batch_size`` window offsets, of which this process keeps
    ``rows``, so a process's rows do not depend on how many processes there are. Only the kept
    windows are read from the memmap.

    Args:
      data: the prepared data.
      seed: >= 0 (train.seed).
      global_batch_size: windows per batch over all processes (train.global_batch_size).
      seq_length: tokens per window (train.seq_length).
      rows: which rows of the global batch this process reads.
    Raises:
      DataError: a split has fewer than seq_length + 1 tokens, or a size/seed is invalid.
    """

    def __init__(self, data: TokenData, *, seed: int, global_batch_size: int, seq_length: int,
                 rows: slice = slice(None)):
        if not (_is_int(seed) or isinstance(seed, np.integer)) or seed < 0:
            raise DataError(f"train.seed={seed!r}: the data loader needs an integer >= 0")
        if global_batch_size < 1 or seq_length < 1:
            raise DataError(f"train.global_batch_size={global_batch_size}, train.seq_length={seq_length}: "
                            f"both must be >= 1")
        for split, arr in (("train", data.train), ("val", data.val)):
            if len(arr) < seq_length + 1:
                more = ("a larger data.val_fraction (or more text)" if split == "val"
                        else "a smaller data.val_fraction or more text")
                raise DataError(f"the {split} split of {data.directory} has {len(arr):,} tokens, but "
                                f"train.seq_length={seq_length} needs at least {seq_length + 1}; use a smaller "
                                f"train.seq_length or {more}")
        self.data, self.seed = data, int(seed)
        self.global_batch_size, self.seq_length = global_batch_size, seq_length
        self.rows = np.arange(global_batch_size)[rows]

    def _batch(self, tokens: np.ndarray, split: int, index: int) -> tuple[np.ndarray, np.ndarray]:
        if index < 0:
            raise DataError(f"batch index {index}: must be >= 0")
        T = self.seq_length
        rng = np.random.default_rng([self.seed, split, int(index)])
        # high is exclusive: offsets lie in [0, len - T - 1], so offset + T + 1 <= len.
        offsets = rng.integers(0, len(tokens) - T, size=self.global_batch_size)[self.rows]
        windows = np.empty((len(offsets), T + 1), dtype=np.int32)
        for r, o in enumerate(offsets):
            windows[r] = tokens[o: o + T + 1]
        if windows.size and int(windows.max()) >= self.data.vocab_size:
            raise DataError(f"{self.data.directory}/{TOKENS}: holds token id {int(windows.max())} >= vocab_size "
                            f"{self.data.vocab_size} from meta.json; the file is corrupt: {_REDO}")
        return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])

    def train_batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Train batch ``step``: (inputs, targets), int32 [len(rows), seq_length]; targets[:, t] is the
        token after inputs[:, t] (so targets[:, :-1] == inputs[:, 1:])."""
        return self._batch(self.data.train, 0, step)

    def eval_batch(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Validation batch ``i``, the same on every call: (inputs, targets), int32 [len(rows), seq_length]."""
        return self._batch(self.data.val, 1, i)
