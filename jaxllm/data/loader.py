"""The data of a run: its datasets, tokenizer and sample indices, and the batches read from them.

    data = Data(cfg, workdir)              # prepares text, opens the blend, builds or loads indices
    batches = Batches(data, rows=slice(a, b))
    tokens = batches.batch("train", step)  # int32 [rows, seq_length + 1]
    inputs, targets = batches.train_batch(step)  # + docs (documents()) with data.reset_position_ids & co.

Batch ``i`` of a split is a pure function of the config and ``i``: the samples
``[i x global_batch, (i + 1) x global_batch)`` of the split in Megatron-LM's order
(:mod:`jaxllm.data.samples`), or with ``data.sampling=uniform`` nanoGPT's windows drawn by
``np.random.default_rng([seed, split, i])``. So a resumed run, or one on another number of
processes or data-parallel size, needs no loader state, and each process reads only its rows.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import numpy as np

from jaxllm.data import blend as blend_lib
from jaxllm.data import cache, samples
from jaxllm.data.indexed import IndexedDataset
from jaxllm.data.text import ensure_prepared, read_meta
from jaxllm.data.tokenizers import make_tokenizer, tokenizer_from_meta
from jaxllm.errors import DataError

SAMPLINGS = ("megatron", "uniform")
SPLIT_IDS = {"train": 0, "valid": 1}
# Bumped when the index files or their meaning change (2: blends break exact ties as Megatron does).
INDEX_VERSION = 2


def resolve_blend(data_cfg, workdir: str, quiet: bool = False, accept_tokenizer=None) -> blend_lib.Blend:
    """The indexed datasets of ``data.file_list`` or ``data.input`` (text prepared into ``WORKDIR/data``; ``quiet``:
    no line saying it is reused; ``accept_tokenizer(tokenizer)``: called before text is prepared with a tokenizer
    other than char's, which its corpus decides, and may raise)."""
    if data_cfg.file_list:
        return blend_lib.read_file_list(data_cfg.file_list)
    parsed = blend_lib.parse_data_path(data_cfg.input)
    if parsed is not None:
        return parsed
    if accept_tokenizer is not None and data_cfg.tokenizer != "char":
        accept_tokenizer(make_tokenizer(data_cfg.tokenizer, data_cfg.gpt2_dir))
    prefix = ensure_prepared(data_cfg, os.path.join(workdir, "data"), quiet=quiet)
    return blend_lib.Blend((prefix,), None, (os.path.basename(os.path.dirname(prefix)),), "data.input")


def _tokenizer(data_cfg, metas: list[dict | None], prefixes):
    """The tokenizer every ``PREFIX.meta.json`` records (they must agree), else ``data.tokenizer``."""
    fields = ("tokenizer", "chars", "gpt2_sha256", "hf_sha256", "sentencepiece_sha256")
    known = [(p, m) for p, m in zip(prefixes, metas) if m is not None]
    if known:
        p0, m0 = known[0]
        for p, m in known[1:]:
            if any(m.get(f) != m0.get(f) for f in fields):
                raise DataError(f"{p0} and {p} were prepared with different tokenizers ({m0['tokenizer']} vs "
                                f"{m['tokenizer']}); a blend needs one tokenizer")
        return tokenizer_from_meta(m0)
    if data_cfg.tokenizer == "char":
        raise DataError(f"data.tokenizer=char: {prefixes[0]} has no .meta.json recording its characters; set "
                        f"data.tokenizer to the tokenizer the data was prepared with (byte, gpt2, a Hugging Face "
                        f"tokenizer.json or a SentencePiece tokenizer.model)")
    return make_tokenizer(data_cfg.tokenizer, data_cfg.gpt2_dir)


class Data:
    """Everything a run reads, opened and checked before anything compiles.

    Args:
      cfg: the config (sections data and train).
      workdir: the run directory (text inputs are prepared into ``WORKDIR/data``).
      splits: the splits to index ("train", "valid").
      quiet: no line saying the prepared text is reused (processes other than 0).
      accept_tokenizer: see :func:`resolve_blend` (a resume's check, before anything is written).
    Attributes:
      blend: the datasets (:class:`jaxllm.data.blend.Blend`); datasets: their IndexedDatasets;
      metas: each one's ``.meta.json`` or None; tokenizer; vocab_size; eod_id (None: the
      tokenizer has none); seq_length; global_batch_size; seed; sampling;
      num_samples: samples per split the run needs (Megatron's derivation);
      weights: normalized blend weights as used (None for one unweighted dataset);
      index_seconds, index_built: the index start-up time and whether it was built (not read).
    Raises:
      DataError: bad inputs (see jaxllm.data.blend, jaxllm.data.indexed), a split with no
        documents, an unwritable cache directory, a bad data.split or data.sampling.
    """

    def __init__(self, cfg, workdir: str, splits=("train", "valid"), quiet: bool = False, accept_tokenizer=None):
        d, t = cfg.data, cfg.train
        if d.sampling not in SAMPLINGS:
            raise DataError(f"data.sampling={d.sampling!r}: choose megatron or uniform")
        self.sampling, self.split, self.splits = d.sampling, d.split, tuple(splits)
        self.matrix = samples.split_matrix(d.split)
        self.seq_length, self.global_batch_size, self.seed = t.seq_length, t.global_batch_size, int(t.seed)
        self.blend = resolve_blend(d, workdir, quiet, accept_tokenizer)
        self.datasets = [IndexedDataset(p, self.blend.key) for p in self.blend.prefixes]
        self.metas = [read_meta(p) for p in self.blend.prefixes]
        self.tokenizer = _tokenizer(d, self.metas, self.blend.prefixes)
        self.vocab_size = int(self.tokenizer.vocab_size)
        self.eod_id = self.tokenizer.eot_id
        if (d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss) and self.eod_id is None:
            raise DataError(f"data.reset_position_ids/reset_attention_mask/eod_mask_loss need an end-of-document "
                            f"token, and the {self.tokenizer.name} tokenizer has none; use gpt2, a Hugging Face "
                            f"tokenizer or a SentencePiece model, or turn them off")
        self.reset_position_ids, self.reset_attention_mask = d.reset_position_ids, d.reset_attention_mask
        self.max_documents_per_sample = d.max_documents_per_sample
        self.eod_mask_loss = d.eod_mask_loss
        self.num_samples = dict(zip(samples.SPLITS, samples.num_samples_per_split(
            t.train_iters, t.global_batch_size, t.eval_interval, t.eval_iters)))
        self.weights = samples.normalize(self.blend.weights) if self.blend.weights is not None else None
        for s in splits:
            if self.matrix[samples.SPLITS.index(s)] is None:
                raise DataError(f"data.split={d.split!r} leaves the {s} split empty; give it a weight (e.g. "
                                f"969,30,1){' or set train.eval_interval=0' if s == 'valid' else ''}")
        t0 = time.perf_counter()
        self.index_built, self._index = False, {}
        if self.sampling == "uniform":
            if len(self.datasets) != 1:
                raise DataError(f"data.sampling=uniform reads one dataset, and {self.blend.key} names "
                                f"{len(self.datasets)}; use data.sampling=megatron for a blend")
            self._uniform = {s: self._uniform_range(s) for s in splits}
        elif splits:
            self.cache_dir = self._cache_dir(d.cache_dir, splits)
            self.index_built = cache.build_once(self.cache_dir, lambda tmp: self._build(tmp, splits),
                                                what=f"the sample indices of {self.blend.key}")
            self._load(splits)
        self.index_seconds = time.perf_counter() - t0

    # --- Megatron order ---------------------------------------------------------------------------

    def _cache_dir(self, configured: str, splits) -> str:
        files = [[p, *(os.stat(p + s).st_size for s in (".bin", ".idx")), os.stat(p + ".idx").st_mtime_ns]
                 for p in self.blend.prefixes]
        self.description = {
            "version": INDEX_VERSION, "datasets": files, "weights": self.blend.weights, "split": self.matrix,
            "seq_length": self.seq_length, "seed": self.seed, "num_samples": self.num_samples,
            "surplus": samples.MID_LEVEL_DATASET_SURPLUS, "splits": list(splits),
        }
        key = hashlib.sha256(json.dumps(self.description).encode()).hexdigest()[:20]
        root = configured or os.path.join(os.path.dirname(self.blend.prefixes[0]), "index-cache")
        try:
            os.makedirs(root, exist_ok=True)
            probe = os.path.join(root, f".probe-{os.getpid()}")
            open(probe, "w").close()
            os.unlink(probe)
        except OSError as e:
            raise DataError(f"data.cache_dir={configured!r}: cannot write the sample indices to {root} "
                            f"({e.strerror or e}); set data.cache_dir to a writable directory that every process "
                            f"sees") from None
        return os.path.join(root, key)

    def _split_sizes(self, split: str):
        """(per-dataset samples to build, blend weights, blend size or None for no blend)."""
        size = self.num_samples[split]
        n = len(self.datasets)
        if self.weights is None and n == 1:
            return [size], None, None
        if self.weights is None:
            return [None] * n, None, size
        target, built = samples.blend_sizes(self.weights, size)
        return built, self.weights, sum(target)

    def _build(self, tmp: str, splits) -> None:
        for s in splits:
            lo_hi = self.matrix[samples.SPLITS.index(s)]
            per_dataset, weights, size = self._split_sizes(s)
            parts = []
            for ds, n in zip(self.datasets, per_dataset):
                beg, end = samples.split_range(lo_hi, ds.num_sequences)
                sizes = np.asarray(ds.sequence_lengths)
                tokens = int(sizes[beg:end].sum(dtype=np.int64))
                if tokens < 2:  # Megatron would loop forever (no document) or assert
                    raise DataError(f"data.split={self.split!r}: the {s} split of {ds.prefix} is sequences "
                                    f"[{beg}, {end}) of {ds.num_sequences:,}, only {tokens} tokens; a split needs at "
                                    f"least 2: use more data (documents) or another data.split")
                parts.append(samples.gpt_indices(sizes, np.arange(beg, end, dtype=np.int32), n, self.seq_length,
                                                 self.seed))
            offsets = np.zeros((len(parts) + 1, 3), np.int64)
            offsets[1:] = np.cumsum([[len(a) for a in p] for p in parts], axis=0)
            for i, name in enumerate(("doc", "sample", "shuffle")):
                np.save(os.path.join(tmp, f"{s}_{name}.npy"), np.concatenate([p[i] for p in parts]))
            np.save(os.path.join(tmp, f"{s}_offsets.npy"), offsets)
            if size is not None:
                lengths = [len(p[2]) for p in parts]
                if weights is None:
                    weights, size = samples.normalize(lengths), min(size, sum(lengths))
                chosen, within = samples.blending_indices(weights, size)
                taken = np.bincount(chosen, minlength=len(parts))
                over = np.nonzero(taken > np.asarray(lengths))[0]
                if len(over):
                    i = int(over[0])
                    raise DataError(f"the {s} blend takes {taken[i]} samples from {self.datasets[i].prefix}, which has "
                                    f"{lengths[i]}; Megatron fails here too: raise the weights' precision or the data")
                np.save(os.path.join(tmp, f"{s}_blend.npy"), chosen)
                np.save(os.path.join(tmp, f"{s}_blend_sample.npy"), within)
        with open(os.path.join(tmp, "description.json"), "w") as f:
            json.dump(self.description, f, indent=1)

    def _load(self, splits) -> None:
        for s in splits:
            arrays = {}
            for name in ("doc", "sample", "shuffle", "offsets", "blend", "blend_sample"):
                path = os.path.join(self.cache_dir, f"{s}_{name}.npy")
                if os.path.isfile(path):
                    arrays[name] = np.load(path, mmap_mode="r", allow_pickle=False)
            self._index[s] = arrays

    def split_length(self, split: str) -> int:
        """Samples in ``split`` (at least ``num_samples[split]``)."""
        if self.sampling == "uniform":
            return self.num_samples[split]
        ix = self._index[split]
        return len(ix["blend"]) if "blend" in ix else int(ix["offsets"][1, 2])

    def _dataset_sample(self, split: str, d: int, j: int) -> np.ndarray:
        """Tokens [seq_length + 1] of sample ``j`` of dataset ``d``'s ``split``."""
        ix = self._index[split]
        o_doc, o_sample, o_shuffle = (int(x) for x in ix["offsets"][d])
        s = int(ix["shuffle"][o_shuffle + j])
        (d0, off0), (d1, off1) = (ix["sample"][o_sample + s]).tolist(), (ix["sample"][o_sample + s + 1]).tolist()
        doc = ix["doc"]
        ds = self.datasets[d]
        if d0 == d1:
            return ds.sequence(int(doc[o_doc + d0]), off0, off1 - off0 + 1)
        parts = [ds.sequence(int(doc[o_doc + d0]), off0)]
        parts += [ds.sequence(int(doc[o_doc + k])) for k in range(d0 + 1, d1)]
        parts.append(ds.sequence(int(doc[o_doc + d1]), 0, off1 + 1))
        return np.concatenate(parts)

    def sample_source(self, split: str, j: np.ndarray) -> np.ndarray:
        """The dataset (index into ``datasets``) of each sample number in ``j``."""
        ix = self._index.get(split, {})
        return np.asarray(ix["blend"][j], np.int64) if "blend" in ix else np.zeros(len(j), np.int64)

    def sample(self, split: str, j: int) -> np.ndarray:
        """Sample ``j`` of ``split`` in Megatron's order: int32 [seq_length + 1]."""
        if not 0 <= j < self.split_length(split):
            raise DataError(f"sample {j} of the {split} split: it has {self.split_length(split):,} (the run's "
                            f"train.train_iters, train.eval_iters and train.global_batch_size decide how many)")
        ix = self._index[split]
        if "blend" in ix:
            return self._dataset_sample(split, int(ix["blend"][j]), int(ix["blend_sample"][j]))
        return self._dataset_sample(split, 0, j)

    # --- nanoGPT's uniform windows ----------------------------------------------------------------

    def _uniform_range(self, split: str) -> tuple[int, int]:
        """Tokens ``[beg, end)`` of the split: data.split cuts the token stream where nanoGPT does
        (``int(0.9 * n)`` for "9,1": floor, where Megatron's document split rounds)."""
        ds = self.datasets[0]
        lo, hi = self.matrix[samples.SPLITS.index(split)]
        beg, end = int(lo * ds.num_tokens), int(hi * ds.num_tokens)
        need = self.seq_length + 1
        if ds.num_tokens < need:  # no split could hold a sample: the sample is too long, not the split wrong
            raise DataError(f"train.seq_length={self.seq_length}: a sample is {need:,} tokens and all of "
                            f"{ds.prefix} is {ds.num_tokens:,}; use a train.seq_length that each split of "
                            f"data.split={self.split!r} can hold, or more text")
        if end - beg < need:
            raise DataError(f"train.seq_length={self.seq_length}: the {split} split of {ds.prefix} has {end - beg:,} "
                            f"tokens, but train.seq_length={self.seq_length} needs at least {need:,}; use "
                            f"train.seq_length <= {max(1, end - beg - 1):,}, give the {split} split more of the text "
                            f"in data.split={self.split!r}, or more text")
        return beg, end

    def uniform_windows(self, split: str, step: int, rows: np.ndarray) -> np.ndarray:
        """int32 [len(rows), seq_length + 1]: windows at offsets ``default_rng([seed, split, step])``
        draws uniformly, ``global_batch_size`` of them, of which ``rows`` are read."""
        beg, end = self._uniform[split]
        t = self.seq_length
        rng = np.random.default_rng([self.seed, SPLIT_IDS[split], int(step)])
        offsets = beg + rng.integers(0, end - beg - t, size=self.global_batch_size)[rows]
        tokens = self.datasets[0].tokens
        return np.stack([tokens[o:o + t + 1] for o in offsets]).astype(np.int32) if len(offsets) else \
            np.zeros((0, t + 1), np.int32)

    # --- what the run reports ---------------------------------------------------------------------

    @property
    def bytes_per_token(self) -> float | None:
        """UTF-8 bytes of text per token of the data as the run mixes it (for bits per byte), or
        None when a dataset has no ``.meta.json`` recording its text's bytes."""
        if any(m is None for m in self.metas):
            return None
        per = [m["text_bytes"] / max(1, m["num_tokens"]) for m in self.metas]
        w = self.weights or samples.normalize([ds.num_tokens for ds in self.datasets])
        return float(np.dot(w, per))

    def describe(self) -> str:
        """One line: datasets, tokens, tokenizer, sampling, split sizes, index time."""
        n = len(self.datasets)
        what = self.datasets[0].prefix if n == 1 else f"a blend of {n} datasets"
        tokens = sum(ds.num_tokens for ds in self.datasets)
        if self.sampling == "uniform":
            how = f"uniform windows, split {self.split} of the tokens"
        else:
            valid = f" / {self.num_samples['valid']:,} valid" if "valid" in self.splits else ""
            how = (f"Megatron order, split {self.split}: {self.num_samples['train']:,} train{valid} samples; "
                   f"indices {'built' if self.index_built else 'read'} in {self.index_seconds:.2f} s")
        return f"data {what} ({tokens:,} {self.tokenizer.name} tokens, vocab {self.vocab_size}; {how})"


# data option -> the array it adds to a batch's ``docs`` (the train step's argument), from :func:`document_masks`.
DOCUMENT_ARRAYS = {"reset_position_ids": "positions", "reset_attention_mask": "segment_ids",
                   "eod_mask_loss": "loss_mask"}


def document_arrays(data_cfg) -> tuple[str, ...]:
    """The names of the ``docs`` arrays the ``data`` config section (or :class:`Data`) asks for (``()``: none)."""
    return tuple(name for key, name in DOCUMENT_ARRAYS.items() if getattr(data_cfg, key))


def documents(inputs: np.ndarray, eod_id: int | None, options) -> dict:
    """The arrays of :func:`document_masks` that the options of ``options`` (the ``data`` config section,
    or :class:`Data`) ask for, by the names the train step takes them (:data:`DOCUMENT_ARRAYS`):
    ``positions`` (reset_position_ids), ``segment_ids`` (reset_attention_mask), ``loss_mask``
    (eod_mask_loss), each ``[rows, seq]`` as ``inputs``; ``{}`` for none.

    Raises:
      DataError: with reset_attention_mask, a row holds more documents than ``max_documents_per_sample``
        (when not 0), the bound cuDNN's packed attention was compiled for."""
    wanted = document_arrays(options)
    if not wanted:
        return {}
    arrays = dict(zip(DOCUMENT_ARRAYS.values(), document_masks(
        inputs, eod_id, options.reset_position_ids, options.reset_attention_mask, options.eod_mask_loss)))
    bound = options.max_documents_per_sample
    if options.reset_attention_mask and bound and arrays["segment_ids"].size:
        most = int(arrays["segment_ids"][:, -1].max()) + 1  # a row's ids count its documents from 0
        if most > bound:
            raise DataError(f"a sample holds {most} documents, more than data.max_documents_per_sample={bound} "
                            f"(the bound of cuDNN's packed attention); raise it, or set it to 0 (no bound: the "
                            f"Pallas kernel)")
    return {name: np.ascontiguousarray(arrays[name]) for name in wanted}


def document_masks(tokens: np.ndarray, eod_id: int | None, reset_position_ids: bool, reset_attention_mask: bool,
                   eod_mask_loss: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions, segment ids and loss mask of input tokens, as Megatron-LM's
    ``_get_ltor_masks_and_position_ids`` (megatron/core/datasets/gpt_dataset.py).

    Args:
      tokens: int [batch, seq] inputs (a sample without its last token).
      eod_id: the end-of-document token (may be None when all options are off).
      reset_position_ids: positions restart at 0 after each end-of-document token.
      reset_attention_mask: segment ids increase after each end-of-document token (a token
        attends only within its segment: Megatron's attention mask, which blocks attention from
        after an EOD at ``i`` to positions ``<= i``); else all 0.
      eod_mask_loss: loss mask 0 where the input token is the end-of-document token.
    Returns:
      positions int32 [batch, seq], segment_ids int32 [batch, seq], loss_mask float32 [batch, seq].
    """
    b, s = tokens.shape
    is_eod = tokens == eod_id if eod_id is not None else np.zeros((b, s), bool)
    # segment of t = EODs strictly before t (an EOD ends its own document's segment)
    before = np.zeros((b, s), np.int32)
    np.cumsum(is_eod[:, :-1], axis=1, out=before[:, 1:])
    segments = before if reset_attention_mask else np.zeros((b, s), np.int32)
    positions = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy()
    if reset_position_ids:
        # start of t's document = 1 + the last EOD position before t (0 if none)
        last_eod = np.where(is_eod, np.arange(s, dtype=np.int32), -1)
        starts = np.zeros((b, s), np.int32)
        starts[:, 1:] = np.maximum.accumulate(last_eod, axis=1)[:, :-1] + 1
        positions -= starts
    loss_mask = np.where(is_eod & eod_mask_loss, 0.0, 1.0).astype(np.float32)
    return positions, segments, loss_mask


class Batches:
    """This process's rows of every global batch.

    Args:
      data: the run's Data.
      rows: the rows of the global batch this process reads (a slice).
      check_vocab: raise DataError on a token id outside the tokenizer's vocabulary (a model
        cannot embed it); ``jaxllm.inspect_data`` shows such data instead.
    """

    def __init__(self, data: Data, rows: slice = slice(None), check_vocab: bool = True):
        self.data, self.check_vocab = data, check_vocab
        self.rows = np.arange(data.global_batch_size)[rows]

    def batch(self, split: str, i: int) -> np.ndarray:
        """Tokens of batch ``i`` of ``split``: int32 [len(rows), seq_length + 1] (inputs, then the last target).

        Raises:
          DataError: ``i`` < 0, past the split's samples, or a token id >= the vocabulary.
        """
        d = self.data
        if i < 0:
            raise DataError(f"batch {i}: must be >= 0")
        if d.sampling == "uniform":
            out = d.uniform_windows(split, i, self.rows)
        else:
            out = np.zeros((len(self.rows), d.seq_length + 1), np.int32)
            for r, row in enumerate(self.rows):
                out[r] = d.sample(split, i * d.global_batch_size + int(row))
        if self.check_vocab and out.size and (int(out.max()) >= d.vocab_size or int(out.min()) < 0):
            bad = int(out.max()) if int(out.max()) >= d.vocab_size else int(out.min())
            raise DataError(f"{d.blend.key}: batch {i} of the {split} split holds token id {bad}, outside the "
                            f"{d.tokenizer.name} tokenizer's vocabulary of {d.vocab_size}; set data.tokenizer to the "
                            f"tokenizer the data was prepared with")
        return out

    def train_batch(self, step: int) -> tuple:
        """Train batch ``step``: (inputs, targets), int32 [len(rows), seq_length], and with any of
        data.reset_position_ids, reset_attention_mask, eod_mask_loss a third element (:meth:`documents`)."""
        return self._split(self.batch("train", step))

    def eval_batch(self, i: int) -> tuple:
        """Validation batch ``i``, as :meth:`train_batch`."""
        return self._split(self.batch("valid", i))

    def _split(self, tokens):
        inputs, targets = np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])
        docs = documents(inputs, self.data.eod_id, self.data)
        return (inputs, targets, docs) if docs else (inputs, targets)


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy of the token frequencies of ``tokens`` (any shape), nats/token: the cross-entropy
    that the best context-free model fitted to these very tokens reaches on them."""
    counts = np.bincount(np.asarray(tokens).reshape(-1), minlength=vocab_size)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
