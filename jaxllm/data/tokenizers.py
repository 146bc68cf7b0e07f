"""Tokenizers: ``char`` (nanoGPT's sorted character set), ``byte`` (UTF-8 bytes), ``gpt2``, any
Hugging Face tokenizer given as a ``tokenizer.json`` file or a local directory holding one, and a
SentencePiece ``tokenizer.model`` (Llama 2, Mistral v0.1; Megatron-LM's ``Llama2Tokenizer``).

All share one small interface::

    name: str                 # "char", "byte", "gpt2", "hf" or "sentencepiece"
    vocab_size: int
    eot_id: int | None        # end-of-document token appended after each document, if any
    encode(text) -> np.ndarray        # int32 [num_tokens]
    encode_batch(texts) -> list[np.ndarray]
    decode(ids) -> str
    meta_fields() -> dict     # what PREFIX.meta.json records so tokenizer_from_meta can rebuild it

``decode`` never raises on an id outside the vocabulary (a model with a padded vocabulary
can sample one): such an id decodes to U+FFFD, the replacement character.
"""

from __future__ import annotations

import hashlib
import os
import re

import numpy as np

from jaxllm.errors import DataError

GPT2_FILES = ("encoder.json", "vocab.bpe")
# GPT-2's files as jaxllm ships them (package data; OpenAI's licence in the LICENSE file beside them).
PACKAGED_GPT2_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt2")
GPT2_VOCAB_SIZE, GPT2_EOT_ID = 50257, 50256  # GPT-2's BPE: 50,257 tokens, <|endoftext|> the last
# The vocabulary of the tokenizers whose size is known without reading data.
KNOWN_VOCAB_SIZES = {"byte": 256, "gpt2": GPT2_VOCAB_SIZE}
REPLACEMENT = "\ufffd"


def gpt2_dir_or_packaged(gpt2_dir: str = "") -> str:
    """``gpt2_dir`` (``data.gpt2_dir``), or the GPT-2 files shipped with jaxllm when it is empty."""
    return gpt2_dir or PACKAGED_GPT2_DIR


def sha256_file(path: str) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class CharTokenizer:
    """One token per Unicode character; ids index ``chars`` (nanoGPT's shakespeare_char).

    Args:
      chars: the vocabulary, one character per id, no repeats (``fit`` gives them sorted).
    Raises:
      DataError: ``chars`` is empty or repeats a character.
    """

    name = "char"
    eot_id = None

    def __init__(self, chars: str):
        if not chars or len(set(chars)) != len(chars):
            raise DataError(f"char tokenizer: the vocabulary must be non-empty distinct characters, got {len(chars)} "
                            f"characters ({len(set(chars))} distinct); build it with CharTokenizer.fit(text)")
        self.chars = chars
        self.vocab_size = len(chars)
        cps = np.frombuffer(chars.encode("utf-32-le"), dtype=np.uint32)
        # Sorted code points + their ids make encode one vectorized searchsorted.
        order = np.argsort(cps, kind="stable")
        self._sorted_cps = cps[order]
        self._sorted_ids = order.astype(np.int32)
        # decode table; the extra last entry is U+FFFD for out-of-vocabulary ids.
        self._decode_cps = np.append(cps, np.uint32(ord(REPLACEMENT)))

    @classmethod
    def fit(cls, text: str) -> CharTokenizer:
        """The tokenizer whose vocabulary is the sorted set of ``text``'s characters."""
        return cls("".join(sorted(set(text))))

    def encode(self, text: str) -> np.ndarray:
        """int32 [len(text)] ids. Raises DataError naming the first character not in the vocabulary."""
        cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        pos = np.searchsorted(self._sorted_cps, cps)
        pos = np.minimum(pos, self.vocab_size - 1)
        bad = self._sorted_cps[pos] != cps
        if bad.any():
            c = chr(int(cps[np.argmax(bad)]))
            raise DataError(f"char tokenizer: character {c!r} (U+{ord(c):04X}) is not in the vocabulary of "
                            f"{self.vocab_size} characters; use only characters of the training corpus, "
                            f"or prepare the data again with the text that contains it (or use tokenizer=byte)")
        return self._sorted_ids[pos]

    def decode(self, ids) -> str:
        """The text of ``ids`` (any int sequence); ids outside [0, vocab_size) decode to U+FFFD."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        ids = np.where((ids >= 0) & (ids < self.vocab_size), ids, self.vocab_size)
        return self._decode_cps[ids].astype("<u4").tobytes().decode("utf-32-le")

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def meta_fields(self) -> dict:
        return {"chars": self.chars}


class ByteTokenizer:
    """The UTF-8 bytes of the text: vocab_size 256, no training, never an unknown token."""

    name = "byte"
    eot_id = None
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        """int32 [number of UTF-8 bytes of text] ids in [0, 256)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        """UTF-8 decode with errors="replace" (a sampled id sequence need not be valid UTF-8)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        # 0xFF never occurs in UTF-8, so an out-of-range id becomes exactly one U+FFFD.
        ids = np.where((ids >= 0) & (ids < 256), ids, 0xFF).astype(np.uint8)
        return ids.tobytes().decode("utf-8", errors="replace")

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def meta_fields(self) -> dict:
        return {}


class GPT2Tokenizer:
    """GPT-2's byte-level BPE, built offline from ``encoder.json`` + ``vocab.bpe`` with HF ``tokenizers``.

    Encodes like OpenAI's reference encoder: no prefix space, and a literal ``<|endoftext|>``
    in the text is ordinary text (it is not turned into ``eot_id``; only prepare adds that,
    between documents).

    Args:
      gpt2_dir: directory holding GPT-2's ``encoder.json`` and ``vocab.bpe``; "" (default): the
        files shipped with jaxllm (:data:`PACKAGED_GPT2_DIR`).
    Raises:
      DataError: a file is missing or unreadable, or the vocabulary is not GPT-2's 50,257 tokens.
    """

    name = "gpt2"
    # Pieces handed to encode_batch: big enough to amortize, small enough to run in parallel.
    chunk_chars = 1 << 20

    def __init__(self, gpt2_dir: str = ""):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        self.gpt2_dir = os.path.abspath(gpt2_dir_or_packaged(gpt2_dir))
        paths = [os.path.join(self.gpt2_dir, n) for n in GPT2_FILES]
        for p in paths:
            if not os.path.isfile(p):
                raise DataError(f"gpt2 tokenizer: {p} not found; set data.gpt2_dir (--gpt2-dir) to the directory "
                                f"holding GPT-2's encoder.json and vocab.bpe, or leave it empty for the files "
                                f"shipped with jaxllm")
        try:
            tok = Tokenizer(models.BPE.from_file(*paths))
        except Exception as e:  # the library raises bare Exceptions on unparsable files
            raise DataError(f"gpt2 tokenizer: cannot load {paths[0]} + {paths[1]} ({e}); "
                            f"use the original GPT-2 encoder.json and vocab.bpe") from None
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.eot_id = tok.token_to_id("<|endoftext|>")
        if self.vocab_size != GPT2_VOCAB_SIZE or self.eot_id != GPT2_EOT_ID:
            raise DataError(f"gpt2 tokenizer: {paths[0]} has {self.vocab_size} tokens and "
                            f"<|endoftext|> = {self.eot_id}, expected {GPT2_VOCAB_SIZE} and {GPT2_EOT_ID}; "
                            "use the original GPT-2 files")

    def encode(self, text: str) -> np.ndarray:
        """int32 [num_tokens] GPT-2 ids of ``text`` (no end-of-text token added)."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """``[encode(t) for t in texts]``, in parallel across texts and across pieces of long texts."""
        pieces, owner = [], []
        for i, text in enumerate(texts):
            for piece in split_for_bpe(text, self.chunk_chars):
                pieces.append(piece)
                owner.append(i)
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # fast: skips offsets
        encodings = encode(pieces, add_special_tokens=False)
        out = [[] for _ in texts]
        for i, enc in zip(owner, encodings):
            out[i].append(np.asarray(enc.ids, dtype=np.int32))
        return [np.concatenate(parts) if parts else np.zeros(0, np.int32) for parts in out]

    def decode(self, ids) -> str:
        """The text of ``ids``; ``eot_id`` decodes to "<|endoftext|>", unknown ids to U+FFFD."""
        ids = np.asarray(ids).reshape(-1)
        if ids.size == 0 or (ids.min() >= 0 and ids.max() < self.vocab_size):
            return self._tok.decode(ids.tolist())
        # The library silently drops unknown ids; keep a visible mark instead.
        parts, run = [], []
        for i in ids:
            if 0 <= i < self.vocab_size:
                run.append(i)
            else:
                parts.append(self._tok.decode(run) if run else "")
                parts.append(REPLACEMENT)
                run = []
        parts.append(self._tok.decode(run) if run else "")
        return "".join(parts)

    def meta_fields(self) -> dict:
        return {"gpt2_dir": self.gpt2_dir,
                "gpt2_sha256": {n: sha256_file(os.path.join(self.gpt2_dir, n)) for n in GPT2_FILES}}


# GPT-2's pre-tokenizer regex ('s|'t|...| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+) always
# starts a new piece at a whitespace character followed by a non-whitespace one: no pattern
# carries whitespace after a non-space, and a whitespace run before such a character splits
# into run[:-1] + (last char, alone or as the " " prefix of the next word) in both the whole
# text and a piece ending there. So text cut there encodes to exactly the same ids as the
# whole (test_gpt2_chunked_encoding_is_exact checks this on random text). ASCII whitespace
# and Python's \S are used because Python's \s is a superset of the library's.
_SAFE_CUT = re.compile(r"[ \t\n\r\f\v](?=\S)")


def split_for_bpe(text: str, chunk_chars: int) -> list[str]:
    """Cuts ``text`` where GPT-2 pre-tokenization always splits (before a whitespace character
    followed by a non-whitespace one) into pieces of about ``chunk_chars`` characters (longer
    where no such place exists). ``"".join(pieces) == text``."""
    pieces, start, chunk_chars = [], 0, max(1, chunk_chars)
    while len(text) - start > chunk_chars:
        m = _SAFE_CUT.search(text, start + chunk_chars)
        if m is None:
            break
        pieces.append(text[start:m.start()])
        start = m.start()
    pieces.append(text[start:])
    return pieces


class HFTokenizer:
    """Any Hugging Face tokenizer, from a ``tokenizer.json`` file or a local directory holding one,
    with the ``tokenizers`` library (nothing is downloaded).

    Encodes as Megatron's ``HuggingFaceTokenizer`` does for ``preprocess_data.py``: the
    tokenizer's own post-processor runs (e.g. Llama's beginning-of-text token is added). The
    end-of-document token is ``eos_token`` of a ``tokenizer_config.json`` beside the
    ``tokenizer.json`` (what transformers' AutoTokenizer reads), else the one special token
    named like an end of text (``<|endoftext|>``, ``<|end_of_text|>``, ``</s>``, ``<eos>``).

    Args:
      path: a ``tokenizer.json`` file or a directory holding one.
    Raises:
      DataError: no tokenizer.json there, it does not load, its model has no vocabulary, or its end-of-document
        token cannot be told.
    """

    name = "hf"
    EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        path = os.path.abspath(path)
        self.path = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(self.path):
            raise DataError(f"data.tokenizer={path}: no tokenizer.json there; give char, byte, gpt2, a Hugging Face "
                            f"tokenizer.json file, a SentencePiece tokenizer.model, or a local directory holding one")
        try:
            self._tok = Tokenizer.from_file(self.path)
        except Exception as e:  # the library raises bare Exceptions on unparsable files
            raise DataError(f"data.tokenizer={self.path}: not a Hugging Face tokenizer.json ({str(e)[:200]}); give the "
                            f"tokenizer.json of the model's Hugging Face repository") from None
        if self._tok.get_vocab_size(with_added_tokens=False) == 0:  # e.g. transformers 5's GPT2TokenizerFast(
            # vocab_file=...), which ignores the file: every text would encode to no token at all
            raise DataError(f"data.tokenizer={self.path}: its model has no vocabulary (only added tokens), so every "
                            f"text encodes to nothing; save the tokenizer again from its vocabulary files")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eot_id = self._eod_id()
        self.sha256 = sha256_file(self.path)

    def _eod_id(self) -> int:
        cfg_path = os.path.join(os.path.dirname(self.path), "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            import json

            try:
                with open(cfg_path, encoding="utf-8") as f:
                    eos = json.load(f).get("eos_token")
            except (ValueError, OSError, AttributeError) as e:
                raise DataError(f"{cfg_path}: unreadable ({e}); fix it or remove it") from None
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if isinstance(eos, str) and self._tok.token_to_id(eos) is not None:
                return self._tok.token_to_id(eos)
        found = [t for t in self.EOD_NAMES if self._tok.token_to_id(t) is not None]
        if len(found) != 1:
            raise DataError(f"data.tokenizer={self.path}: cannot tell its end-of-document token (special tokens named "
                            f"like one: {found or 'none'}); put a tokenizer_config.json with \"eos_token\" beside it, "
                            f"as the model's Hugging Face repository has")
        return self._tok.token_to_id(found[0])

    def encode(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        """int32 [num_tokens] ids of ``text``: with the special tokens its post-processor adds (e.g. a
        beginning-of-text token), or without them (``add_special_tokens=False``: the text's own tokens)."""
        if not add_special_tokens:
            return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """``[encode(t) for t in texts]``, in parallel across texts."""
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [np.asarray(e.ids, dtype=np.int32) for e in encode(texts)]

    def decode(self, ids) -> str:
        """The text of ``ids`` with special tokens shown; ids outside the vocabulary decode to U+FFFD."""
        ids = np.asarray(ids).reshape(-1)
        parts, run = [], []
        for i in ids.tolist():
            if 0 <= i < self.vocab_size:
                run.append(i)
            else:
                parts += [self._tok.decode(run, skip_special_tokens=False), REPLACEMENT]
                run = []
        parts.append(self._tok.decode(run, skip_special_tokens=False))
        return "".join(parts)

    def meta_fields(self) -> dict:
        return {"hf_path": self.path, "hf_sha256": self.sha256}


class SentencePieceTokenizer:
    """A SentencePiece ``tokenizer.model`` (Llama 2, Mistral v0.1), read by the ``sentencepiece`` library.

    Encodes as Megatron-LM's ``_Llama2Tokenizer`` (megatron/training/tokenizer/tokenizer.py) does for
    ``preprocess_data.py``: the model's beginning-of-sentence id, then ``SentencePieceProcessor.encode``
    of the text (whose control pieces such as ``<s>`` are ordinary text there); the end-of-document
    token is the model's end-of-sentence id (Megatron's ``eod``).  ``vocab_size`` is the model's
    piece count.

    Args:
      path: the ``.model`` file.
    Raises:
      DataError: sentencepiece is not installed, the file is missing or not a SentencePiece model, or the
        model has no beginning- or end-of-sentence piece (``bos_id``/``eos_id`` -1 when trained).
    """

    name = "sentencepiece"

    def __init__(self, path: str):
        try:
            import sentencepiece
        except ImportError:
            raise DataError(f"data.tokenizer={path}: a SentencePiece model needs the sentencepiece library, which "
                            f"is not installed: pip install sentencepiece (or jaxllm[sentencepiece])") from None
        self.path = os.path.abspath(path)
        if not os.path.isfile(self.path):
            raise DataError(f"data.tokenizer={path}: no such SentencePiece model file; give the model's "
                            f"tokenizer.model")
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=self.path)
        except (RuntimeError, OSError) as e:
            raise DataError(f"data.tokenizer={self.path}: not a SentencePiece model ({str(e)[:200]}); give the "
                            f"model's tokenizer.model") from None
        self.vocab_size = self._sp.get_piece_size()
        self.bos_id, self.eot_id = self._sp.bos_id(), self._sp.eos_id()
        if self.bos_id < 0 or self.eot_id < 0:
            raise DataError(f"data.tokenizer={self.path}: the SentencePiece model has no beginning- or "
                            f"end-of-sentence piece (bos_id {self.bos_id}, eos_id {self.eot_id}); Megatron's "
                            f"Llama2Tokenizer needs both: use a model trained with them (as Llama 2's)")
        self.sha256 = sha256_file(self.path)

    def encode(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        """int32 [num_tokens] ids of ``text``, after the beginning-of-sentence id (``add_special_tokens=False``:
        the text's own ids)."""
        return np.asarray(self._sp.encode(text, add_bos=add_special_tokens), dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """``[encode(t) for t in texts]``, in the library's threads."""
        return [np.asarray(ids, dtype=np.int32) for ids in self._sp.encode(texts, add_bos=True)]

    def decode(self, ids) -> str:
        """The text of ``ids`` as ``SentencePieceProcessor.decode`` gives it, except that control pieces are
        shown (``<s>``, ``</s>``, as the Hugging Face tokenizers show special tokens) and ids outside the
        vocabulary decode to U+FFFD (the library raises on them)."""
        parts, run = [], []
        for i in np.asarray(ids).reshape(-1).tolist():
            if 0 <= i < self.vocab_size and not self._sp.is_control(i):
                run.append(i)
                continue
            parts += [self._sp.decode(run), self._sp.id_to_piece(i) if 0 <= i < self.vocab_size else REPLACEMENT]
            run = []
        parts.append(self._sp.decode(run))
        return "".join(parts)

    def meta_fields(self) -> dict:
        return {"sentencepiece_path": self.path, "sentencepiece_sha256": self.sha256}


TOKENIZER_NAMES = ("char", "byte", "gpt2")
SENTENCEPIECE_FILE = "tokenizer.model"  # the SentencePiece model's name in a model's directory (Llama 2, Mistral)


def file_tokenizer(path: str):
    """The tokenizer of a file or directory ``path``: a ``*.model`` file, or a directory holding a
    ``tokenizer.model`` but no ``tokenizer.json``, is a :class:`SentencePieceTokenizer`; anything else
    an :class:`HFTokenizer`.  Raises DataError (see those classes)."""
    model = os.path.join(path, SENTENCEPIECE_FILE)
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "tokenizer.json")) and os.path.isfile(model):
        path = model
    return SentencePieceTokenizer(path) if path.endswith(".model") else HFTokenizer(path)


def make_tokenizer(spec: str, gpt2_dir: str = ""):
    """The tokenizer ``data.tokenizer`` names, except ``char`` (fitted to a corpus: :meth:`CharTokenizer.fit`).

    Args:
      spec: "byte", "gpt2", or a path: a Hugging Face tokenizer.json, a SentencePiece tokenizer.model, or a
        directory holding one (:func:`file_tokenizer`).
      gpt2_dir: GPT-2's encoder.json + vocab.bpe directory (spec "gpt2"); "": the files shipped with jaxllm.
    Raises:
      DataError: unknown spec, missing files.
    """
    if spec == "byte":
        return ByteTokenizer()
    if spec == "gpt2":
        return GPT2Tokenizer(gpt2_dir)
    if spec == "char":
        raise ValueError("the char tokenizer is fitted to its corpus: CharTokenizer.fit(text)")
    if not os.path.exists(spec):
        raise DataError(f"data.tokenizer={spec!r}: choose char, byte, gpt2, or the path of a Hugging Face "
                        f"tokenizer.json, a SentencePiece tokenizer.model, or a local directory holding one")
    return file_tokenizer(spec)


def tokenizer_from_meta(meta: dict, gpt2_dir: str | None = None):
    """Rebuilds the tokenizer that a ``PREFIX.meta.json`` records (:mod:`jaxllm.data.text`).

    Args:
      meta: the parsed metadata.
      gpt2_dir: for gpt2, read the files from here instead of the recorded directory
        (e.g. after moving them); their checksums must still match. Where the recorded directory
        is gone (data prepared on another machine, or by another installation of jaxllm), the
        files shipped with jaxllm are used when their checksums are the recorded ones.
    Returns:
      a CharTokenizer, ByteTokenizer, GPT2Tokenizer, HFTokenizer or SentencePieceTokenizer.
    Raises:
      DataError: unknown tokenizer, missing fields, or the tokenizer files are missing or changed
        since the data was prepared.
    """
    name = meta.get("tokenizer")
    if name == "byte":
        return ByteTokenizer()
    if name == "char":
        chars = meta.get("chars")
        if not isinstance(chars, str):
            raise DataError("meta.json: tokenizer 'char' without its 'chars' string; prepare the data again")
        return CharTokenizer(chars)
    if name in ("hf", "sentencepiece"):
        path, recorded = meta.get(f"{name}_path"), meta.get(f"{name}_sha256")
        if not isinstance(path, str) or not os.path.isfile(path):
            raise DataError(f"{name} tokenizer: {path} (recorded in meta.json) not found; put it back, or prepare "
                            f"the data again")
        if sha256_file(path) != recorded:
            raise DataError(f"{name} tokenizer: {path} changed since the data was prepared (sha256 differs from "
                            f"meta.json); restore the original file or prepare the data again")
        return HFTokenizer(path) if name == "hf" else SentencePieceTokenizer(path)
    if name == "gpt2":
        recorded = meta.get("gpt2_sha256")
        directory = gpt2_dir or meta.get("gpt2_dir")
        if not isinstance(directory, str) or not isinstance(recorded, dict):
            raise DataError("meta.json: tokenizer 'gpt2' without 'gpt2_dir' and 'gpt2_sha256'; prepare the data again")
        missing = not all(os.path.isfile(os.path.join(directory, n)) for n in GPT2_FILES)
        if missing and not gpt2_dir and all(
                sha256_file(os.path.join(PACKAGED_GPT2_DIR, n)) == recorded.get(n) for n in GPT2_FILES):
            directory = PACKAGED_GPT2_DIR  # the same files, shipped with this jaxllm
        for n in GPT2_FILES:
            path = os.path.join(directory, n)
            if not os.path.isfile(path):
                raise DataError(f"gpt2 tokenizer: {path} (recorded in meta.json) not found; put GPT-2's files back "
                                f"there, or prepare the data again with --gpt2-dir pointing at them")
            if sha256_file(path) != recorded.get(n):
                raise DataError(f"gpt2 tokenizer: {path} changed since the data was prepared (sha256 differs from "
                                f"meta.json); restore the original file or prepare the data again")
        return GPT2Tokenizer(directory)
    raise DataError(f"meta.json: unknown tokenizer {name!r}; expected char, byte, gpt2, hf or sentencepiece "
                    f"(prepare the data again)")
