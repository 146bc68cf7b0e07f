"""What ``data.input`` / ``data.file_list`` name: text to prepare, or a blend of indexed datasets.

``data.input`` is one of
  * a Megatron ``--data-path``: ``"W1 PREFIX1 W2 PREFIX2 ..."`` (weights, normalized to sum 1)
    or ``"PREFIX"`` or ``"PREFIX1 PREFIX2 ..."`` (no weights: each dataset's size is its weight),
    with the rules of Megatron's ``get_blend_from_list``;
  * text files or directories, comma-separated (prepared into an indexed dataset by
    :func:`jaxllm.data.text.ensure_prepared`).
``data.file_list`` (when set, instead of ``data.input``) is an ALCF Megatron-DeepSpeed data-file
list: one ``weight prefix corpus`` line per dataset (``#`` comments and blank lines skipped; a
missing corpus is the prefix's file name). The weights blend the prefixes as Megatron-LM's
BlendedDataset does; the corpus only groups the proportions jaxllm reports.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from jaxllm.data import indexed
from jaxllm.errors import DataError


@dataclass(frozen=True)
class Blend:
    """Indexed datasets and how to mix them.

    Attributes:
      prefixes: absolute prefixes, in order.
      weights: one float per prefix as given (Megatron normalizes them), or None (mix by size).
      corpora: a group name per prefix (ALCF's corpus column, else the prefix's file name).
      key: the config key they came from, for messages.
    """

    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None
    corpora: tuple[str, ...]
    key: str


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_data_path(text: str, key: str = "data.input") -> Blend | None:
    """A Megatron ``--data-path`` string -> Blend, or None when ``text`` names no indexed dataset
    (then it is text to prepare).

    Raises:
      DataError: a weighted list (numbers in the weight places) naming a prefix with no
        .bin/.idx, a weight <= 0 or one that is not a number (a word that is neither a number nor
        a path, before an indexed prefix), or an indexed list mixing in a path that is not indexed.
    """
    words = text.split()
    if not words:
        return None
    for w in words:
        if w.endswith((".bin", ".idx")) and indexed.exists(w[:-4]):
            raise DataError(f"{key}: {w}: name the indexed dataset by its prefix, {w[:-4]} (without .bin/.idx)")
    weights = None
    prefixes = words
    if len(words) % 2 == 0:
        nums = [_number(w) for w in words[0::2]]
        if all(n is not None for n in nums):
            weights, prefixes = nums, words[1::2]
    indexed_ones = [p for p in prefixes if indexed.exists(p)]
    if weights is None and not indexed_ones:
        return None
    if weights is None and len(words) % 2 == 0:
        # "abc PREFIX": a weight that is not a number before an indexed dataset, not a prefix of its own
        for w, p in zip(words[0::2], words[1::2]):
            if _number(w) is None and not indexed.exists(w) and not os.path.exists(w) and indexed.exists(p):
                raise DataError(f"{key}: weight {w!r} of {p} is not a number; write \"W1 PREFIX1 W2 PREFIX2 ...\" "
                                f"with a number before each prefix (e.g. \"0.5 {p}\"), or the prefixes alone")
    for p in prefixes:
        if not indexed.exists(p):
            raise DataError(f"{key}: {p}: no {p}.bin or {p}.idx (a blend names Megatron indexed datasets by prefix: "
                            f"\"W1 PREFIX1 W2 PREFIX2 ...\", without .bin/.idx)")
    if weights is not None:
        for w, p in zip(weights, prefixes):
            if not w > 0:
                raise DataError(f"{key}: weight {w} of {p}: weights must be > 0")
    prefixes = tuple(os.path.abspath(p) for p in prefixes)
    return Blend(prefixes, None if weights is None else tuple(weights),
                 tuple(os.path.basename(p) for p in prefixes), key)


def read_file_list(path: str) -> Blend:
    """An ALCF data-file list (``weight prefix corpus`` per line) -> Blend.

    Raises:
      DataError: the file is missing, a line does not have 2 or 3 fields, a weight is not a
        number > 0, a prefix has no .bin/.idx, or the list is empty.
    """
    key = "data.file_list"
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise DataError(f"{key}={path}: cannot read it ({e.strerror or e}); give an ALCF data-file list (one "
                        f"\"weight prefix corpus\" line per dataset)") from None
    prefixes, weights, corpora = [], [], []
    for n, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        w = _number(fields[0]) if len(fields) in (2, 3) else None
        if w is None or not w > 0:
            raise DataError(f"{path}:{n}: {line.strip()!r}: expected \"weight prefix corpus\" with a weight > 0 "
                            f"({key} is an ALCF data-file list)")
        prefix = os.path.abspath(fields[1])  # a relative prefix is the working directory's: errors name it resolved
        if not indexed.exists(prefix):
            raise DataError(f"{path}:{n}: {prefix}: no {prefix}.bin or .idx; the prefix of a Megatron indexed "
                            f"dataset, without .bin/.idx")
        prefixes.append(prefix)
        weights.append(w)
        corpora.append(fields[2] if len(fields) == 3 else os.path.basename(fields[1]))
    if not prefixes:
        raise DataError(f"{key}={path}: names no dataset; one \"weight prefix corpus\" line per dataset")
    return Blend(tuple(prefixes), tuple(weights), tuple(corpora), key)
