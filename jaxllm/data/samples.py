"""Which tokens make sample ``j`` of a split: Megatron-LM's GPTDataset and BlendedDataset orders.

A reimplementation, in numpy (and one JAX loop), of Megatron-LM ``megatron/core/datasets``
(``gpt_dataset.py``, ``blended_dataset.py``, ``blended_megatron_dataset_builder.py``,
``blended_megatron_dataset_config.py``, ``helpers.cpp``; megatron-core 0.16), so that the
same ``.bin/.idx``, seed, sequence length, split, blend and sample counts give the same
samples, token for token (tests/test_megatron.py checks it against megatron-core itself):

* split: ``"969,30,1"`` -> normalized fractions -> cumulative book-ends; split ``s`` of a
  dataset with ``N`` sequences is sequences ``[round(lo * N), round(hi * N))``.
* one dataset, one split, ``num_samples`` wanted: epochs ``E`` = fewest whole passes over the
  split's tokens ``T`` with ``E * T >= num_samples * seq_length + 1``. The document index is
  the split's sequence ids repeated ``E`` times and shuffled by ``np.random.RandomState(seed)``;
  when the last epoch would contribute fewer than 80% of an epoch's samples it is shuffled
  separately ("separate final epoch"). Sample ``k`` is the tokens at positions
  ``[k * seq_length, k * seq_length + seq_length + 1)`` of the documents concatenated in that
  order (samples overlap by one token and run across document boundaries), for
  ``k < (E * T - 1) // seq_length``; the sample index records each start as (document index
  position, offset). The shuffle index, a permutation of the samples by the same RandomState
  (the separate final epoch's samples permuted among themselves), gives sample ``j`` of the split.
* a blend with weights ``w`` (normalized) and ``size`` wanted: dataset ``d`` is built for
  ``ceil(ceil(size * w_d) * 1.005)`` samples, the blend has ``sum_d ceil(size * w_d)`` samples,
  and blended sample ``j`` is sample ``c_d(j)`` of dataset ``d = argmax_d (w_d * max(j, 1) - c_d(j))``
  (first maximum, the product rounded to float64 before the subtraction, so exact ties go to the
  first dataset; ``c_d(j)``: samples taken from ``d`` before ``j``): Megatron's
  error-minimizing ``build_blending_indices``.
* a blend without weights: each dataset is one epoch of its split, weighted by its sample count,
  and the blend has ``min(size, sum of counts)`` samples.
"""

from __future__ import annotations

import math
import re

import numpy as np

from jaxllm.errors import DataError

SPLITS = ("train", "valid", "test")
# Megatron-LM's BlendedMegatronDatasetConfig.mid_level_dataset_surplus default.
MID_LEVEL_DATASET_SURPLUS = 0.005
# A final epoch giving fewer than this fraction of an epoch's samples is shuffled separately.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def parse_split(split: str, key: str = "data.split") -> list[float]:
    """``"969,30,1"`` -> ``[0.969, 0.03, 0.001]``: Megatron's ``parse_and_normalize_split``
    (every number in the string, padded with zeros to three, divided by their sum).

    Raises:
      DataError: more than three numbers, none positive, or a number that does not parse.
    """
    try:
        parts = [float(x) for x in re.findall(r"[.0-9]+", split)]
    except ValueError:
        parts = None
    if parts is None or not 0 < len(parts) <= 3 or not sum(parts) > 0:
        raise DataError(f"{key}={split!r}: give up to three non-negative weights for train, validation, test "
                        f"(Megatron's --split), e.g. 969,30,1")
    parts += [0.0] * (3 - len(parts))
    w = np.asarray(parts, np.float64)
    return (w / w.sum()).tolist()


def split_matrix(split: str, key: str = "data.split") -> list[tuple[float, float] | None]:
    """The book-ends ``(lo, hi)`` of each split (None for an empty one), as Megatron's
    ``convert_split_vector_to_split_matrix``."""
    vec = parse_split(split, key)
    ends = [0.0]
    for v in vec:
        ends.append(ends[-1] + v)
    return [(lo, hi) if hi > lo else None for lo, hi in zip(ends[:-1], ends[1:])]


def split_range(bookends: tuple[float, float], num_elements: int) -> tuple[int, int]:
    """``[beg, end)`` of the elements (sequences) in a split."""
    return int(round(bookends[0] * float(num_elements))), int(round(bookends[1] * float(num_elements)))


def num_samples_per_split(train_iters: int, global_batch_size: int, eval_interval: int,
                          eval_iters: int) -> tuple[int, int, int]:
    """(train, validation, test) samples a run needs, as Megatron-LM's training loop derives them
    (``get_train_valid_test_num_samples``): train ``train_iters x global batch``; validation
    ``(train_iters // eval_interval + 1) x eval_iters x global batch`` (every evaluation reads
    new batches, plus one at the end); test ``eval_iters x global batch``. ``eval_interval`` 0
    (jaxllm: no evaluation) counts one evaluation, as Megatron's ``--skip-train`` does."""
    evals = (train_iters // eval_interval + 1) if eval_interval else 1
    return (train_iters * global_batch_size, evals * eval_iters * global_batch_size, eval_iters * global_batch_size)


def blend_sizes(weights: list[float], size: int) -> tuple[list[int], list[int]]:
    """(samples the blend takes from each dataset, samples each dataset is built for), for
    normalized ``weights`` and a split of ``size`` samples (Megatron's ``_get_size_per_split_per_dataset``)."""
    target = [int(math.ceil(size * w)) for w in weights]
    built = [int(math.ceil(t * (1 + MID_LEVEL_DATASET_SURPLUS))) for t in target]
    return target, built


def normalize(weights) -> list[float]:
    w = np.asarray(weights, np.float64)
    return (w / w.sum()).tolist()


def num_epochs(tokens_per_epoch: int, num_samples: int | None, seq_length: int) -> int:
    """Fewest passes giving ``num_samples`` samples of ``seq_length + 1`` tokens (1 when None)."""
    if num_samples is None:
        return 1
    need = num_samples * seq_length + 1
    return max(1, -(-need // tokens_per_epoch))


def build_document_index(documents: np.ndarray, epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """int32 [epochs x len(documents)]: the documents repeated ``epochs`` times, shuffled (the
    last epoch on its own when ``separate_final_epoch``), Megatron's ``_build_document_index``."""
    if not separate_final_epoch or epochs == 1:
        index = np.tile(np.asarray(documents, np.int32), epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, epochs - 1, rng, False)
    return np.concatenate([first, build_document_index(documents, 1, rng, False)])


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int,
                       num_samples: int, chunk: int = 1 << 22) -> np.ndarray:
    """[num_samples + 1, 2]: row ``k`` = (position in ``document_index``, token offset) of token
    ``k x seq_length`` of the documents concatenated in ``document_index`` order (row 0 is (0, 0)).
    The values of Megatron's ``helpers.build_sample_idx`` (drop_last_partial_sequence,
    add_extra_token_to_sequence), computed by a binary search over cumulative lengths, in
    chunks so that memory stays O(chunk). int32 when every value fits, else int64, as Megatron.

    Args:
      sizes: int32 [num sequences] lengths; document_index: int32 [M] sequence ids.
      num_samples: ``(total tokens - 1) // seq_length``.
      chunk: documents per binary search.
    """
    big = max(len(document_index), int(sizes.max())) > np.iinfo(np.int32).max
    out = np.zeros((num_samples + 1, 2), np.int64 if big else np.int32)
    base, k = 0, 1
    for start in range(0, len(document_index), chunk):
        if k > num_samples:
            break
        lengths = sizes[document_index[start:start + chunk]].astype(np.int64)
        ends = base + np.cumsum(lengths)
        stop = min(num_samples + 1, -(-int(ends[-1]) // seq_length))  # first k with k*S >= this chunk's end
        if stop > k:
            q = np.arange(k, stop, dtype=np.int64) * seq_length
            d = np.searchsorted(ends, q, side="right")  # the (non-empty) document holding token q
            out[k:stop, 0] = d + start
            out[k:stop, 1] = q - (ends[d] - lengths[d])
            k = stop
        base = int(ends[-1])
    return out


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """[total_size]: ``[0, num_samples)`` shuffled, then ``[num_samples, total_size)`` shuffled
    (Megatron's ``_build_shuffle_index``; uint32 unless that is too small)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


def gpt_indices(sizes: np.ndarray, documents: np.ndarray, num_samples: int | None, seq_length: int,
                seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document index, sample index, shuffle index) of one split of one dataset, as Megatron's
    ``GPTDataset._build_document_sample_shuffle_indices``.

    Args:
      sizes: int32 [num sequences] of the dataset; documents: the split's sequence ids.
      num_samples: samples wanted (None: one epoch).
      seq_length: tokens per sample, less the extra target token.
      seed: the RandomState seed (train.seed).
    Returns:
      int32 [E x len(documents)], int32/int64 [n + 1, 2], uint32/int64 [n] (``n`` samples >= num_samples).
    The split must hold at least 2 tokens.
    """
    tokens = int(np.sum(sizes[documents], dtype=np.int64))
    epochs = num_epochs(tokens, num_samples, seq_length)
    separate = False
    if epochs > 1:
        sans_final = ((epochs - 1) * tokens - 1) // seq_length
        from_final = num_samples - sans_final
        per_epoch = (tokens - 1) // seq_length
        separate = from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
    rng = np.random.RandomState(seed)
    doc_index = build_document_index(documents, epochs, rng, separate)
    total = (epochs * tokens - 1) // seq_length
    sample_index = build_sample_index(sizes, doc_index, seq_length, total)
    shuffle = build_shuffle_index(sans_final if separate else total, total, rng)
    return doc_index, sample_index, shuffle


def blending_indices(weights: list[float], size: int, chunk_elements: int = 1 << 21) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each blended sample int16 [size], its sample number in that dataset int64 [size]):
    Megatron's ``helpers.build_blending_indices``, bit for bit, ties included.

    Megatron picks, for sample ``n``, the first ``d`` with the largest ``w_d * max(n, 1) - c_d``
    in float64, the product rounded to a double before the subtraction (helpers.cpp is compiled
    without fused multiply-adds). Where two errors tie exactly (weights 0.7/0.3 at sample 10: both
    0.0) a fused multiply-add would make them differ by an ulp and pick the other dataset, and
    XLA's CPU backend fuses ``w * n - c`` whatever barrier stands between. So the products are
    computed by numpy (correctly rounded, never fused), a chunk of samples at a time, and the
    compiled loop only subtracts and compares.

    The loop is sequential by nature (each choice changes the next errors), so it runs as one
    compiled XLA loop on the CPU per chunk, about 50 ns per sample for a few datasets (a Python
    loop would take microseconds per sample: minutes for a real run's hundred million samples).

    Args:
      weights: normalized float64 weights, one per dataset.
      size: blended samples.
      chunk_elements: samples x datasets of float64 products held at once (16 MiB by default).
    """
    import jax
    import jax.numpy as jnp

    if size == 0:
        return np.zeros(0, np.int16), np.zeros(0, np.int64)
    try:
        cpu = jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        raise DataError("building the blending index runs on JAX's CPU backend, which JAX_PLATFORMS leaves out; "
                        "add cpu to it (e.g. JAX_PLATFORMS=cuda,cpu)") from None
    w = np.asarray(weights, np.float64)
    rows = int(min(size, max(1, chunk_elements // len(w))))
    chosen = np.empty(size, np.int16)
    with jax.enable_x64(True), jax.default_device(cpu):

        def body(i, state):
            counts, out, products = state
            d = jnp.argmax(products[i] - counts)  # the first maximum, as Megatron's strict `>`
            return counts.at[d].add(1.0), out.at[i].set(d.astype(jnp.int16)), products

        @jax.jit
        def run(counts, start, n):
            steps = jnp.maximum(start + jnp.arange(rows, dtype=jnp.float64), 1.0)
            # Rounded float64 products, as helpers.cpp: computed before the loop, a separate
            # kernel, so that no multiply-add can fuse them with the subtraction inside it.
            products = jax.lax.optimization_barrier(steps[:, None] * jnp.asarray(w)[None, :])
            counts, out, _ = jax.lax.fori_loop(0, n, body, (counts, jnp.zeros(rows, jnp.int16), products))
            return counts, out

        counts = jnp.zeros(len(w), jnp.float64)
        for start in range(0, size, rows):
            n = min(rows, size - start)
            counts, out = run(counts, np.float64(start), n)
            chosen[start:start + n] = np.asarray(out)[:n]
    # The sample number within each dataset: a running count per dataset.
    order = np.argsort(chosen, kind="stable")
    per_dataset = np.bincount(chosen, minlength=len(w))
    within = np.empty(size, np.int64)
    within[order] = np.arange(size) - np.repeat(np.cumsum(per_dataset) - per_dataset, per_dataset)
    return chosen, within
