"""jaxllm.data on the real corpora in ../shared/data: tokenizers, prepare, TokenData, Loader."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxllm.config import get_config
from jaxllm.data import ByteTokenizer, CharTokenizer, DataError, GPT2Tokenizer, Loader, TokenData, tokenizer_from_meta
from jaxllm.data.prepare import collect_files, ensure_prepared, prepare
from jaxllm.data.tokenizers import split_for_bpe

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
SHAKESPEARE = SHARED / "tinyshakespeare.txt"
PEPS = SHARED / "peps.txt"
GPT2_DIR = SHARED / "gpt2"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shakespeare():
    return SHAKESPEARE.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def gpt2():
    return GPT2Tokenizer(str(GPT2_DIR))


@pytest.fixture(scope="module")
def peps_passage():
    with open(PEPS, encoding="utf-8") as f:
        f.seek(1_000_000)
        f.readline()  # start on a line boundary
        return f.read(60_000)


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "shakespeare_char"
    prepare([str(SHAKESPEARE)], "char", str(out))
    return out


def data_cfg(inputs, tokenizer="byte", val_fraction=0.1, gpt2_dir=""):
    cfg = get_config().data
    cfg.input = ",".join(map(str, inputs))
    cfg.tokenizer, cfg.val_fraction, cfg.gpt2_dir = tokenizer, val_fraction, str(gpt2_dir)
    return cfg


# --- tokenizers ---------------------------------------------------------------------------------

def test_char_roundtrip(shakespeare):
    tok = CharTokenizer.fit(shakespeare)
    assert tok.vocab_size == 65 and tok.chars == "".join(sorted(set(shakespeare))) and tok.eot_id is None
    ids = tok.encode(shakespeare)
    assert ids.dtype == np.int32 and len(ids) == len(shakespeare)
    assert tok.decode(ids) == shakespeare
    assert tok.encode("A").tolist() == [tok.chars.index("A")]
    assert tok.decode([0, 65, -1]) == "\n\ufffd\ufffd"  # out-of-vocabulary ids never raise
    with pytest.raises(DataError, match=r"'é'.*not in the vocabulary"):
        tok.encode("café")


def test_byte_roundtrip():
    tok = ByteTokenizer()
    text = "naïve café — 日本語, emoji 😀🐍\r\n\ttab"
    ids = tok.encode(text)
    assert tok.vocab_size == 256 and ids.dtype == np.int32
    assert len(ids) == len(text.encode("utf-8")) and tok.decode(ids) == text
    assert tok.decode(tok.encode("😀")[:2]) == "\ufffd"  # a cut multi-byte char is replaced, not an error
    assert tok.decode([104, 300, 105]) == "h\ufffdi"


def test_gpt2_known_ids_and_roundtrip(gpt2, peps_passage):
    assert gpt2.vocab_size == 50257 and gpt2.eot_id == 50256
    assert gpt2.encode("Hello world").tolist() == [15496, 995]
    assert gpt2.encode(" the").tolist() == [262]
    assert gpt2.decode([50256]) == "<|endoftext|>"
    assert gpt2.encode("<|endoftext|>").tolist() != [50256]  # literal text, like OpenAI's encoder
    ids = gpt2.encode(peps_passage)
    assert len(ids) < len(peps_passage) / 2.5  # real BPE merges, not bytes
    assert gpt2.decode(ids) == peps_passage


def test_gpt2_chunked_encoding_is_exact(gpt2, peps_passage):
    """Long documents are encoded in pieces (for parallelism); the ids must equal the whole's."""
    def check(text, chunk_chars):
        pieces = split_for_bpe(text, chunk_chars)
        assert "".join(pieces) == text
        whole = gpt2._tok.encode(text).ids
        assert sum((gpt2._tok.encode(p).ids for p in pieces), []) == whole
        return len(pieces)

    assert check(peps_passage, 2000) > 10
    # Cut at every allowed place in random text dense in whitespace runs, contractions,
    # digits, CRLF, and characters whose whitespace-ness differs between regex engines.
    rng = np.random.default_rng(0)
    alphabet = [" ", " ", "  ", "\n", "\r\n", "\t", "\n    ", "a", "Zé", "7", "'s", "'", "!", ".", "\u00a0",
                "\u2028", "\x1c", "\u3000", "\U0001F600", "x", "\f", "\v", "\x85"]
    for _ in range(5):
        text = "".join(rng.choice(alphabet, size=400))
        assert check(text, 1) > 20


# --- prepare ------------------------------------------------------------------------------------

def test_prepare_shakespeare_char(char_dir, shakespeare):
    meta = json.loads((char_dir / "meta.json").read_text())
    n = 1_115_394
    assert meta["tokenizer"] == "char" and meta["vocab_size"] == 65 and meta["dtype"] == "uint16"
    assert meta["num_tokens"] == n and meta["train_tokens"] == int(n * 0.9) == 1_003_854
    assert meta["val_tokens"] == n - int(n * 0.9)
    src = meta["sources"]
    assert src == [{"path": str(SHAKESPEARE), "bytes": n, "sha256": hashlib.sha256(SHAKESPEARE.read_bytes()).hexdigest()}]
    tokens = np.fromfile(char_dir / "tokens.bin", dtype=np.uint16)
    tok = tokenizer_from_meta(meta)
    np.testing.assert_array_equal(tokens, tok.encode(shakespeare))
    data = TokenData(str(char_dir))
    assert data.vocab_size == 65 and len(data.train) == int(n * 0.9) and len(data.val) == n - int(n * 0.9)
    assert data.tokenizer.decode(data.train) + data.tokenizer.decode(data.val) == shakespeare
    assert not (set(os.listdir(char_dir.parent)) - {"shakespeare_char"})  # no temp dirs left beside it


def test_prepare_cli(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "jaxllm.data.prepare", "--input", str(SHAKESPEARE), "--tokenizer", "byte",
           "--output", str(out), "--val-fraction", "0.2"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "1,115,394 byte tokens" in r.stderr and "Warning" not in r.stderr  # no runpy double-import warning
    meta = json.loads((out / "meta.json").read_text())
    assert meta["val_tokens"] == 1_115_394 - int(1_115_394 * 0.8)
    r = subprocess.run(cmd[:-4] + ["--output", str(tmp_path / "x"), "--input", str(tmp_path / "nope")],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no such file or directory" in r.stderr and not (tmp_path / "x").exists()


def test_directory_walk_and_join(tmp_path):
    root = tmp_path / "corpus"
    files = {"b.py": "print('b')\n", "a.txt": "alpha", "sub/c.md": "# c", "sub/d.rst": "d",
             "skip.bin": "no", ".hidden/h.py": "no", "site-packages/s.py": "no", "dist-packages/s.py": "no",
             "__pycache__/p.py": "no", "sub/.h.py": "no"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "latin1.txt").write_bytes("café".encode("latin-1"))
    found = [os.path.relpath(p, root) for p in collect_files([str(root)])]
    assert found == ["a.txt", "b.py", "latin1.txt", os.path.join("sub", "c.md"), os.path.join("sub", "d.rst")]
    meta = prepare([str(root), str(root / "a.txt")], "byte", str(tmp_path / "out"), val_fraction=0.5)
    assert len(meta["sources"]) == 5  # a file named twice is read once
    text = ByteTokenizer().decode(np.fromfile(tmp_path / "out" / "tokens.bin", dtype=np.uint16))
    assert text == "alpha\nprint('b')\n\ncaf\ufffd\n# c\nd"  # joined by "\n"; invalid UTF-8 replaced


def test_prepare_gpt2_appends_eot(tmp_path, gpt2):
    for name, text in (("a.txt", "Hello world"), ("b.txt", " the")):
        (tmp_path / name).write_text(text)
    meta = prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], "gpt2", str(tmp_path / "out"),
                   gpt2_dir=str(GPT2_DIR), val_fraction=0.4)
    tokens = np.fromfile(tmp_path / "out" / "tokens.bin", dtype=np.uint16)
    assert tokens.tolist() == [15496, 995, 50256, 262, 50256]
    assert meta["eot_id"] == 50256 and meta["train_tokens"] == 3 and meta["val_tokens"] == 2
    assert meta["gpt2_sha256"]["vocab.bpe"] == hashlib.sha256((GPT2_DIR / "vocab.bpe").read_bytes()).hexdigest()


def test_prepare_is_atomic(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("good text " * 1000)
    (src / "zz.txt").symlink_to(tmp_path / "missing")  # fails when read, after a.txt was written
    out = tmp_path / "out" / "data"
    with pytest.raises(DataError, match="zz.txt: cannot read"):
        prepare([str(src)], "byte", str(out))
    assert not out.exists() and os.listdir(tmp_path / "out") == []  # not even a temp dir
    # A directory with other files in it is never replaced.
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="not a prepared directory"):
        prepare([str(src / "a.txt")], "byte", str(tmp_path / "keep"))
    # A prepared one is, completely.
    prepare([str(src / "a.txt")], "byte", str(out))
    prepare([str(SHAKESPEARE)], "char", str(out))
    assert TokenData(str(out)).meta["tokenizer"] == "char" and os.listdir(tmp_path / "out") == ["data"]


# --- loader -------------------------------------------------------------------------------------

def test_loader_deterministic(char_dir):
    data = TokenData(str(char_dir))
    kw = dict(seed=7, global_batch_size=8, seq_length=64)
    x, y = Loader(data, **kw).train_batch(3)
    assert x.shape == y.shape == (8, 64) and x.dtype == y.dtype == np.int32
    x2, y2 = Loader(TokenData(str(char_dir)), **kw).train_batch(3)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    assert not np.array_equal(x, Loader(data, **kw).train_batch(4)[0])
    assert not np.array_equal(x, Loader(data, **{**kw, "seed": 8}).train_batch(3)[0])
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    # the documented draw: all offsets from default_rng([seed, 0, step]) over [0, len - seq_length - 1]
    offsets = np.random.default_rng([7, 0, 3]).integers(0, len(data.train) - 64, size=8)
    for r, o in enumerate(offsets):
        np.testing.assert_array_equal(x[r], data.train[o:o + 64])
        np.testing.assert_array_equal(y[r], data.train[o + 1:o + 65])


def test_loader_rows_are_slices_of_global_batch(char_dir):
    data = TokenData(str(char_dir))
    kw = dict(seed=1, global_batch_size=8, seq_length=32)
    full_x, full_y = Loader(data, **kw).train_batch(11)
    for rows in (slice(0, 4), slice(4, 8), slice(2, 3), slice(1, None, 2)):
        x, y = Loader(data, rows=rows, **kw).train_batch(11)
        np.testing.assert_array_equal(x, full_x[rows])
        np.testing.assert_array_equal(y, full_y[rows])


def test_eval_batches_fixed_and_from_val(char_dir):
    data = TokenData(str(char_dir))
    loader = Loader(data, seed=1, global_batch_size=4, seq_length=16)
    a, b = loader.eval_batch(0), loader.eval_batch(0)
    np.testing.assert_array_equal(a[0], b[0])
    assert not np.array_equal(a[0], loader.eval_batch(1)[0])
    val_text = data.tokenizer.decode(data.val)
    for row in a[0]:
        assert data.tokenizer.decode(row) in val_text


# --- errors -------------------------------------------------------------------------------------

def copy_prepared(src, dst):
    dst.mkdir()
    for name in ("meta.json", "tokens.bin"):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def test_missing_directory(tmp_path):
    with pytest.raises(DataError, match="no such directory.*jaxllm.data.prepare"):
        TokenData(str(tmp_path / "absent"))
    with pytest.raises(DataError, match="meta.json: not found"):
        TokenData(str(tmp_path))


def test_broken_token_files(char_dir, tmp_path):
    d = copy_prepared(char_dir, tmp_path / "d")
    size = (d / "tokens.bin").stat().st_size
    with open(d / "tokens.bin", "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(DataError, match=r"tokens.bin: truncated: .* bytes, but meta.json says .*prepare again"):
        TokenData(str(d))
    with open(d / "tokens.bin", "ab") as f:
        f.write(b"\0" * 20)
    with pytest.raises(DataError, match="tokens.bin: longer than meta.json says"):
        TokenData(str(d))
    (d / "tokens.bin").write_bytes(b"")
    with pytest.raises(DataError, match="tokens.bin: empty"):
        TokenData(str(d))
    (d / "tokens.bin").unlink()
    with pytest.raises(DataError, match="tokens.bin: not found"):
        TokenData(str(d))


def test_malformed_meta(char_dir, tmp_path):
    d = copy_prepared(char_dir, tmp_path / "d")
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match="malformed meta.json"):
        TokenData(str(d))
    (d / "meta.json").write_text(json.dumps({**meta, "val_tokens": 5}))
    with pytest.raises(DataError, match="malformed meta.json.*val_tokens"):
        TokenData(str(d))
    (d / "meta.json").write_text(json.dumps({**meta, "dtype": "float32"}))
    with pytest.raises(DataError, match="malformed meta.json.*dtype"):
        TokenData(str(d))


def test_check_vocab(char_dir):
    data = TokenData(str(char_dir))
    data.check_vocab(65)
    data.check_vocab(128)
    with pytest.raises(DataError, match=r"model.vocab_size=64 .*\(65 char tokens\).*>= 65"):
        data.check_vocab(64)


def test_split_too_short(tmp_path):
    (tmp_path / "t.txt").write_text("x" * 1000)
    prepare([str(tmp_path / "t.txt")], "byte", str(tmp_path / "out"), val_fraction=0.05)
    data = TokenData(str(tmp_path / "out"))
    Loader(data, seed=0, global_batch_size=2, seq_length=49)  # val has 50 tokens: just enough
    with pytest.raises(DataError, match=r"val split .* 50 tokens.*seq_length=50 needs at least 51.*val_fraction"):
        Loader(data, seed=0, global_batch_size=2, seq_length=50)
    with pytest.raises(DataError, match=r"train split .* 950 tokens.*seq_length=2000"):
        Loader(data, seed=0, global_batch_size=2, seq_length=2000)


def test_gpt2_files_changed_after_prepare(tmp_path):
    vocab = tmp_path / "gpt2"
    vocab.mkdir()
    for name in ("encoder.json", "vocab.bpe"):
        (vocab / name).write_bytes((GPT2_DIR / name).read_bytes())
    (tmp_path / "t.txt").write_text("Hello world. " * 50)
    prepare([str(tmp_path / "t.txt")], "gpt2", str(tmp_path / "out"), gpt2_dir=str(vocab))
    assert TokenData(str(tmp_path / "out")).tokenizer.decode([15496]) == "Hello"
    with open(vocab / "vocab.bpe", "a") as f:
        f.write("x y\n")
    with pytest.raises(DataError, match=r"vocab.bpe changed since the data was prepared.*prepare the data again"):
        TokenData(str(tmp_path / "out")).tokenizer
    with pytest.raises(DataError, match="gpt2_dir"):
        prepare([str(tmp_path / "t.txt")], "gpt2", str(tmp_path / "out2"))


# --- ensure_prepared ----------------------------------------------------------------------------

def test_ensure_prepared_reuses_cache(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("print('hello')\n" * 100)
    (src / "b.txt").write_text("some text\n" * 100)
    cache = tmp_path / "cache"
    d1 = ensure_prepared(data_cfg([src]), str(cache))
    stamp = {n: os.stat(os.path.join(d1, n)).st_mtime_ns for n in ("meta.json", "tokens.bin")}
    d2 = ensure_prepared(data_cfg([src]), str(cache))
    assert d1 == d2 and stamp == {n: os.stat(os.path.join(d1, n)).st_mtime_ns for n in stamp}
    assert TokenData(d1).meta["num_tokens"] == 1500 + 1 + 1000
    # other settings or changed sources -> another cache entry
    assert ensure_prepared(data_cfg([src], val_fraction=0.2), str(cache)) != d1
    (src / "b.txt").write_text("changed\n")
    d3 = ensure_prepared(data_cfg([src]), str(cache))
    assert d3 != d1 and TokenData(d3).meta["num_tokens"] == 1500 + 1 + 8
    # a prepared directory as input is used as it is
    assert ensure_prepared(data_cfg([d1]), str(tmp_path / "other")) == d1
    assert not (tmp_path / "other").exists()
    # a broken cache entry is prepared again
    with open(os.path.join(d3, "tokens.bin"), "r+b") as f:
        f.truncate(10)
    assert ensure_prepared(data_cfg([src]), str(cache)) == d3 and TokenData(d3).meta["num_tokens"] == 1509


def test_unigram_entropy(tmp_path):
    (tmp_path / "a.txt").write_text("aab" * 30 + "abcd" * 10)  # train: "aab" x 30 (90 chars), val: "abcd" x 10 + ...
    meta = prepare([str(tmp_path / "a.txt")], "byte", str(tmp_path / "out"), val_fraction=40 / 130)
    data = TokenData(str(tmp_path / "out"))
    assert meta["train_tokens"] == 90
    h = lambda *p: -sum(q * np.log(q) for q in p)  # noqa: E731
    assert data.unigram_entropy("train") == pytest.approx(h(2 / 3, 1 / 3), rel=1e-12)
    assert data.unigram_entropy("val") == pytest.approx(h(1 / 4, 1 / 4, 1 / 4, 1 / 4), rel=1e-12)
    assert data.unigram_entropy("all") == pytest.approx(h(70 / 130, 40 / 130, 10 / 130, 10 / 130), rel=1e-12)
    with pytest.raises(ValueError, match="split='test'"):
        data.unigram_entropy("test")
