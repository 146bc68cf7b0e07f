"""jaxllm.data on real text (Tiny Shakespeare in tests/data, Python's standard library as a marked
many-document corpus, GPT-2's shipped BPE files): tokenizers, prepare (indexed datasets), the
reader, blends, Megatron-order and uniform batches, masks, the index cache, inspect, bad inputs.
(Equality with Megatron-LM itself: tests/test_megatron.py.)"""

import json
import os
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import forkserver
import numpy as np
import pytest
from conftest import (
    MARKER,
    TINY_SHAKESPEARE,
    corpus_documents,
    english_passage,
    shakespeare_documents,
    train_sentencepiece,
)

from jaxllm.config import get_config
from jaxllm.data.cache import build_once
from jaxllm.data.indexed import IndexedDataset
from jaxllm.data.loader import Batches, Data, document_masks, unigram_entropy
from jaxllm.data.text import collect_files, ensure_prepared, iter_documents, prepare, read_meta
from jaxllm.data.tokenizers import (
    PACKAGED_GPT2_DIR,
    ByteTokenizer,
    CharTokenizer,
    GPT2Tokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    make_tokenizer,
    split_for_bpe,
    tokenizer_from_meta,
)
from jaxllm.errors import DataError
from jaxllm.inspect_data import parse_steps

SHAKESPEARE = TINY_SHAKESPEARE
GPT2_DIR = Path(PACKAGED_GPT2_DIR)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shakespeare():
    return SHAKESPEARE.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def gpt2():
    return GPT2Tokenizer()  # the files shipped with jaxllm


@pytest.fixture(scope="module")
def prose():
    return english_passage(60_000)


def run_cfg(inp, *, tokenizer="byte", split="969,30,1", seq=64, gb=8, iters=50, eval_interval=10, eval_iters=2,
            seed=1234, sampling="megatron", cache_dir="", **data):
    cfg = get_config()
    cfg.data.update(input=str(inp), tokenizer=tokenizer, split=split, sampling=sampling, cache_dir=str(cache_dir),
                    **data)
    cfg.train.update(seq_length=seq, global_batch_size=gb, micro_batch_size=gb, train_iters=iters,
                     eval_interval=eval_interval, eval_iters=eval_iters, seed=seed)
    return cfg


def cli(module, *args, cwd=REPO):
    return forkserver.run(["-m", module, *args], {**os.environ, "JAX_PLATFORMS": "cpu"}, cwd, 300)


def one_error_line(r, start="data error: "):
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(start), r.stderr
    return lines[0]


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


def test_gpt2_known_ids_and_roundtrip(gpt2, prose):
    assert gpt2.vocab_size == 50257 and gpt2.eot_id == 50256
    assert gpt2.encode("Hello world").tolist() == [15496, 995]
    assert gpt2.encode(" the").tolist() == [262]
    assert gpt2.decode([50256]) == "<|endoftext|>"
    assert gpt2.encode("<|endoftext|>").tolist() != [50256]  # literal text, like OpenAI's encoder
    ids = gpt2.encode(prose)
    assert len(ids) < len(prose) / 2.5  # real BPE merges, not bytes
    assert gpt2.decode(ids) == prose


def test_gpt2_chunked_encoding_is_exact(gpt2, prose):
    """Long documents are encoded in pieces (for parallelism); the ids must equal the whole's."""
    def check(text, chunk_chars):
        pieces = split_for_bpe(text, chunk_chars)
        assert "".join(pieces) == text
        whole = gpt2._tok.encode(text).ids
        assert sum((gpt2._tok.encode(p).ids for p in pieces), []) == whole
        return len(pieces)

    assert check(prose, 2000) > 10
    # Cut at every allowed place in random text dense in whitespace runs, contractions,
    # digits, CRLF, and characters whose whitespace-ness differs between regex engines.
    rng = np.random.default_rng(0)
    alphabet = [" ", " ", "  ", "\n", "\r\n", "\t", "\n    ", "a", "Zé", "7", "'s", "'", "!", ".", "\u00a0",
                "\u2028", "\x1c", "\u3000", "\U0001F600", "x", "\f", "\v", "\x85"]
    for _ in range(5):
        text = "".join(rng.choice(alphabet, size=400))
        assert check(text, 1) > 20


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """GPT-2's tokenizer as a Hugging Face repository has it: tokenizer.json + tokenizer_config.json."""
    from transformers import GPT2TokenizerFast

    d = tmp_path_factory.mktemp("hf_gpt2")
    GPT2TokenizerFast(vocab=str(GPT2_DIR / "encoder.json"), merges=str(GPT2_DIR / "vocab.bpe")).save_pretrained(d)
    return d


def test_hf_tokenizer_file_or_directory(hf_dir, gpt2, prose, tmp_path):
    for spec in (hf_dir, hf_dir / "tokenizer.json"):
        tok = HFTokenizer(str(spec))
        assert tok.vocab_size == 50257 and tok.eot_id == 50256
        np.testing.assert_array_equal(tok.encode(prose), gpt2.encode(prose))
        assert tok.decode(tok.encode(prose)) == prose
        assert tok.decode([50256, 99999]) == "<|endoftext|>\ufffd"
    # a bare tokenizer.json: the end of document is the one special token named like it
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    assert HFTokenizer(str(tmp_path / "bare")).eot_id == 50256
    # none named like one, and no tokenizer_config.json: say so
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE.from_file(str(GPT2_DIR / "encoder.json"), str(GPT2_DIR / "vocab.bpe"))).save(
        str(tmp_path / "noeod.json"))
    spec = json.loads((tmp_path / "noeod.json").read_text())
    spec["model"]["vocab"].pop("<|endoftext|>")
    (tmp_path / "noeod.json").write_text(json.dumps(spec))
    with pytest.raises(DataError, match="cannot tell its end-of-document token.*tokenizer_config.json"):
        HFTokenizer(str(tmp_path / "noeod.json"))
    with pytest.raises(DataError, match="no tokenizer.json there"):
        HFTokenizer(str(tmp_path))
    # transformers 5 ignores GPT2TokenizerFast's vocab_file=: a tokenizer of no vocabulary but its added token
    from transformers import GPT2TokenizerFast

    GPT2TokenizerFast(vocab_file=str(GPT2_DIR / "encoder.json"), merges_file=str(GPT2_DIR / "vocab.bpe")
                      ).save_pretrained(tmp_path / "empty")
    with pytest.raises(DataError, match="has no vocabulary"):
        HFTokenizer(str(tmp_path / "empty"))


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    """A Llama-2-style SentencePiece tokenizer.model (byte fallback, whitespace kept) of 400 pieces."""
    return train_sentencepiece(tmp_path_factory.mktemp("spm") / "tokenizer.model")


SPM_TEXTS = ["First Citizen:\nBefore we proceed any further, hear me speak.", "  two leading spaces",
             "tabs\tand\r\nnewlines\n\n\nthree", "ünïcödé 😀 ∑ 中文 2026", "a literal <s> and </s>", " ", ""]


def test_sentencepiece_is_megatrons_llama2_tokenizer(spm_model, hf_dir, tmp_path):
    """Megatron-LM's _Llama2Tokenizer.tokenize: [bos] + SentencePieceProcessor.encode(text), eod = eos; decode
    as the library's, the control pieces shown and unknown ids U+FFFD."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_model))
    tok = make_tokenizer(str(spm_model))
    assert isinstance(tok, SentencePieceTokenizer) and tok.name == "sentencepiece"
    assert (tok.vocab_size, tok.bos_id, tok.eot_id) == (sp.get_piece_size(), sp.bos_id(), sp.eos_id()) == (400, 1, 2)
    for text, ids in zip(SPM_TEXTS, tok.encode_batch(SPM_TEXTS)):
        assert tok.encode(text).tolist() == ids.tolist() == [sp.bos_id()] + sp.encode(text)
        assert tok.encode(text, add_special_tokens=False).tolist() == sp.encode(text)
        assert tok.decode(ids[1:]) == sp.decode(ids[1:].tolist()) == text  # byte fallback: nothing lost
    assert 1 not in tok.encode("a literal <s>").tolist()[1:]  # control pieces in the text are text
    ids = tok.encode("speak.").tolist()
    assert tok.decode(ids + [2, 400, -1]) == "<s>speak.</s>\ufffd\ufffd"
    # a directory: its tokenizer.json first, else its tokenizer.model
    (tmp_path / "both").mkdir()
    (tmp_path / "both" / "tokenizer.model").write_bytes(spm_model.read_bytes())
    assert make_tokenizer(str(tmp_path / "both")).sha256 == tok.sha256
    (tmp_path / "both" / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    assert isinstance(make_tokenizer(str(tmp_path / "both")), HFTokenizer)
    (tmp_path / "x.model").write_bytes(b'{"not": "a model"}')
    with pytest.raises(DataError, match="x.model: not a SentencePiece model"):
        make_tokenizer(str(tmp_path / "x.model"))
    no_eos = train_sentencepiece(tmp_path / "no_eos.model", eos_id=-1)
    with pytest.raises(DataError, match=r"no beginning- or end-of-sentence piece \(bos_id 1, eos_id -1\)"):
        make_tokenizer(str(no_eos))


def test_sentencepiece_prepare_and_meta_round_trip(spm_model, tmp_path):
    """prepare writes [bos] + ids + [eos] per document and records the model's path and checksum; the meta
    rebuilds it, and refuses the model once changed."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_model))
    model = tmp_path / "tokenizer.model"
    model.write_bytes(spm_model.read_bytes())
    docs = shakespeare_documents()[:50]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    meta = prepare([str(tmp_path / "a.jsonl")], str(model), str(tmp_path / "out"), progress=False)
    assert meta["tokenizer"] == "sentencepiece" and meta["eot_id"] == sp.eos_id()
    ds = IndexedDataset(str(tmp_path / "out"))
    for i in (0, 1, 49):
        assert ds.sequence(i).tolist() == [sp.bos_id()] + sp.encode(docs[i]) + [sp.eos_id()]
    rebuilt = tokenizer_from_meta(read_meta(str(tmp_path / "out")))
    assert rebuilt.path == str(model) and rebuilt.decode(ds.sequence(0)) == f"<s>{docs[0]}</s>"
    model.write_bytes(train_sentencepiece(tmp_path / "other.model", vocab_size=500).read_bytes())
    with pytest.raises(DataError, match=r"sentencepiece tokenizer: .*tokenizer.model changed since the data was "
                                        r"prepared"):
        tokenizer_from_meta(read_meta(str(tmp_path / "out")))


# --- prepare: indexed datasets --------------------------------------------------------------------

def test_prepare_one_document_per_marked_part(stdlib_byte, stdlib_corpus):
    ds, meta = IndexedDataset(stdlib_byte), read_meta(stdlib_byte)
    docs = corpus_documents(stdlib_corpus)
    names = [ln.split()[1] for ln in stdlib_corpus.read_text(encoding="utf-8").splitlines() if ln.startswith(MARKER)]
    assert len(docs) == ds.num_documents == ds.num_sequences == meta["num_documents"] == len(names) > 500
    assert ds.dtype == np.uint16 and meta["eot_id"] is None  # byte: no end-of-document token
    n = len(docs)
    for i in (0, 1, n // 2, n - 1):
        assert ByteTokenizer().decode(ds.sequence(i)) == docs[i]
    first = Path(sysconfig.get_paths()["stdlib"], names[0].removeprefix("Lib/")).read_text(encoding="utf-8")
    assert docs[0] == first and not any(MARKER in d for d in docs)
    raw = np.concatenate([np.frombuffer(d.encode(), np.uint8) for d in docs])
    np.testing.assert_array_equal(ds.tokens, raw)  # the whole stream: the documents back to back
    assert meta["text_bytes"] == meta["num_tokens"] == len(raw) == ds.num_tokens
    assert not [n for n in os.listdir(os.path.dirname(stdlib_byte)) if n.startswith(".")]  # no temporary files


def test_prepare_shakespeare_jsonl_gpt2_appends_eod(shakespeare_gpt2, gpt2):
    ds, meta = IndexedDataset(shakespeare_gpt2), read_meta(shakespeare_gpt2)
    docs = shakespeare_documents()
    assert ds.num_documents == len(docs) == 7222 and meta["eot_id"] == 50256 and meta["tokenizer"] == "gpt2"
    for i in (0, 1, 4000, 7221):
        assert ds.sequence(i).tolist() == gpt2.encode(docs[i]).tolist() + [50256]
    assert ds.num_tokens == sum(len(gpt2.encode(d)) + 1 for d in docs[:100]) + int(ds.sequence_lengths[100:].sum())
    assert tokenizer_from_meta(meta).decode(ds.sequence(0)).startswith("First Citizen:\nBefore we proceed")


def test_prepare_cli_workers_and_formats(tmp_path):
    docs = shakespeare_documents()[:300]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": d, "n": i}) + "\n" for i, d in enumerate(docs[:200])))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": docs[200:]}), tmp_path / "b.parquet", row_group_size=30)
    outs = []
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        r = cli("jaxllm.prepare", "--input", str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet"),
                "--tokenizer", "gpt2", "--json-key", "body", "--output-prefix",
                str(prefix), "--workers", str(workers))
        assert r.returncode == 0, r.stderr
        assert "prepare: 300 documents" in r.stderr and "tokens/s" in r.stderr and "Warning" not in r.stderr
        outs.append([(prefix.with_suffix(s)).read_bytes() for s in (".bin", ".idx")])
    assert outs[0] == outs[1]  # the same bytes from 1 or 2 tokenizing processes
    ds = IndexedDataset(str(tmp_path / "w2"))
    assert GPT2Tokenizer(str(GPT2_DIR)).decode(ds.sequence(250)) == docs[250] + "<|endoftext|>"
    # bad inputs: one line, exit 2, nothing written
    (tmp_path / "bad.jsonl").write_text('{"body": "fine"}\n{"text": "no body"}\n')
    r = cli("jaxllm.prepare", "--input", str(tmp_path / "bad.jsonl"), "--tokenizer", "byte", "--json-key", "body",
            "--output-prefix", str(tmp_path / "x"))
    assert "bad.jsonl:2: no string at key 'body'" in one_error_line(r)
    r = cli("jaxllm.prepare", "--input", str(tmp_path / "nope"), "--tokenizer", "byte", "--output-prefix",
            str(tmp_path / "x"))
    assert "no such file or directory" in one_error_line(r)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(("x", ".x"))]


def test_parquet_without_pyarrow_says_so(tmp_path):
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    code = ("import sys; sys.modules['pyarrow'] = None\n"
            "from jaxllm.prepare import main; sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "--input", str(tmp_path / "t.parquet"), "--tokenizer", "byte",
                        "--output-prefix", str(tmp_path / "x")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "reading Parquet needs pyarrow, which is not installed: pip install pyarrow" in one_error_line(r)


def test_directory_walk_one_document_per_file(tmp_path):
    root = tmp_path / "corpus"
    files = {"b.py": "print('b')\n", "a.txt": "alpha", "sub/c.md": "# c", "sub/d.rst": "d",
             "sub/e.jsonl": '{"text": "e"}\n',
             "skip.bin": "no", "skip.json": "{}", ".hidden/h.py": "no", "site-packages/s.py": "no",
             "dist-packages/s.py": "no", "__pycache__/p.py": "no", "sub/.h.py": "no", "empty.txt": ""}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "latin1.txt").write_bytes("café".encode("latin-1"))
    found = [os.path.relpath(p, root) for p in collect_files([str(root)])]
    assert found == ["a.txt", "b.py", "empty.txt", "latin1.txt",
                     *(os.path.join("sub", n) for n in ("c.md", "d.rst", "e.jsonl"))]
    # café's one Latin-1 byte is 4% of this tiny corpus, over the default limit for binary input (1%)
    meta = prepare([str(root), str(root / "a.txt")], "byte", str(tmp_path / "out"), progress=False,
                   max_undecodable=0.05)
    ds = IndexedDataset(str(tmp_path / "out"))
    assert len(meta["sources"]) == 7 and ds.num_documents == 6  # a file named twice is read once; empty: no document
    texts = [ByteTokenizer().decode(ds.sequence(i)) for i in range(6)]
    assert texts == ["alpha", "print('b')\n", "caf\ufffd", "# c", "d", "e"]


def test_prepare_is_atomic_and_keeps_foreign_data(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("good text " * 1000)
    (src / "zz.txt").symlink_to(tmp_path / "missing")  # fails when read, after a.txt was tokenized
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(DataError, match="zz.txt: cannot read"):
        prepare([str(src)], "byte", str(out / "data"), progress=False)
    assert os.listdir(out) == []  # not even a temporary file
    # Megatron's own data (no .meta.json) is never overwritten; what prepare wrote is, completely
    (out / "m.bin").write_bytes(b"\0\0")
    (out / "m.idx").write_bytes(b"x")
    with pytest.raises(DataError, match="not written by jaxllm.prepare"):
        prepare([str(src / "a.txt")], "byte", str(out / "m"), progress=False)
    prepare([str(src / "a.txt")], "byte", str(out / "data"), progress=False)
    prepare([str(SHAKESPEARE)], "char", str(out / "data"), progress=False)
    assert read_meta(str(out / "data"))["tokenizer"] == "char"
    assert IndexedDataset(str(out / "data")).num_tokens == 1115394
    assert sorted(os.listdir(out)) == ["data.bin", "data.idx", "data.meta.json", "m.bin", "m.idx"]


# --- the reader's errors ----------------------------------------------------------------------------

def test_reader_errors_are_one_clear_line(shakespeare_gpt2, tmp_path):
    def copy(name):
        for s in (".bin", ".idx"):
            (tmp_path / (name + s)).write_bytes(Path(shakespeare_gpt2 + s).read_bytes())
        return str(tmp_path / name)

    def idx_with(name, offset, data):
        p = copy(name)
        with open(p + ".idx", "r+b") as f:
            f.seek(offset)
            f.write(data)
        return p

    cases = [
        (str(tmp_path / "absent"), r"absent.idx, .*absent.bin not found.*PREFIX.bin \+ PREFIX.idx"),
        (idx_with("magic", 0, b"NOTMEGA"), r"not a Megatron index \(magic"),
        (idx_with("version", 9, (2).to_bytes(8, "little")), r"index version 2, this reader knows version 1"),
        (idx_with("dtype", 17, bytes([9])), r"token dtype code 9 is not one Megatron defines"),
    ]
    p = copy("short_bin")
    with open(p + ".bin", "r+b") as f:
        f.truncate(1000)
    cases.append((p, r"short_bin.bin: truncated: 1,000 bytes, but .* places its last sequence's end at byte"))
    p = copy("short_idx")
    with open(p + ".idx", "r+b") as f:
        f.truncate(5000)
    cases.append((p, r"short_idx.idx: truncated: 5000 bytes, but its header says 7,222 sequences"))
    p = copy("half")
    os.unlink(p + ".bin")
    cases.append((p, r"half.bin not found"))
    for prefix, pattern in cases:
        with pytest.raises(DataError, match=pattern):
            IndexedDataset(prefix)
    # through the CLIs: one line, exit 2, no traceback, nothing written
    r = cli("jaxllm.inspect_data", f"--config.data.input={tmp_path / 'magic'}", f"--workdir={tmp_path / 'w'}",
            "--steps=0:1", f"--output={tmp_path / 'o.npy'}")
    assert "not a Megatron index" in one_error_line(r) and not (tmp_path / "o.npy").exists()


# --- batches ------------------------------------------------------------------------------------------

def test_batches_are_the_documents_in_megatron_order(stdlib_byte, stdlib_corpus, tmp_path):
    """Each sample is seq_length + 1 tokens of the documents concatenated in the document index's order,
    starting at (shuffled sample) x seq_length; the samples of a split use only its documents."""
    data = Data(run_cfg(stdlib_byte, cache_dir=tmp_path, seq=256, gb=8, iters=30), str(tmp_path))
    assert data.num_samples == {"train": 240, "valid": 4 * 2 * 8, "test": 16}
    ix = data._index["train"]
    stream = np.concatenate([data.datasets[0].sequence(int(d)) for d in ix["doc"]])
    batches = Batches(data)
    n = len(corpus_documents(stdlib_corpus))
    beg, end = 0, round(0.969 * n)
    for step in (0, 7, 29):
        tokens = batches.batch("train", step)
        assert tokens.shape == (8, 257) and tokens.dtype == np.int32
        for r in range(8):
            k = int(ix["shuffle"][step * 8 + r])
            np.testing.assert_array_equal(tokens[r], stream[k * 256:k * 256 + 257])
    assert set(np.unique(ix["doc"])) == set(range(beg, end))
    valid = Data(run_cfg(stdlib_byte, cache_dir=tmp_path, seq=256, gb=8, iters=30),
                 str(tmp_path))._index["valid"]["doc"]
    assert set(np.unique(valid)) == set(range(end, round(0.999 * n))) and len(np.unique(valid)) > 1
    x, y = batches.train_batch(3)
    np.testing.assert_array_equal(x, batches.batch("train", 3)[:, :-1])
    np.testing.assert_array_equal(y, batches.batch("train", 3)[:, 1:])


def test_resume_on_another_data_parallel_size_reads_the_same_batches(stdlib_byte, stdlib_corpus, tmp_path):
    """Batch i is a function of the config and i: any rows, any process, fresh or cached, in any order."""
    cfg = run_cfg(stdlib_byte, cache_dir=tmp_path, seq=64, gb=12, iters=40)
    first = Data(cfg, str(tmp_path))
    assert first.index_built
    straight = np.stack([Batches(first).batch("train", s) for s in range(40)])
    again = Data(cfg, str(tmp_path))  # a restarted run: the indices are read, not built
    assert not again.index_built
    for dp in (2, 3, 4):  # a resumed run at step 17 with dp processes, each reading only its rows
        per = 12 // dp
        for s in (17, 39, 18):
            rows = [Batches(again, rows=slice(p * per, (p + 1) * per)).batch("train", s) for p in range(dp)]
            np.testing.assert_array_equal(np.concatenate(rows), straight[s])
    np.testing.assert_array_equal(Batches(again, rows=slice(1, None, 5)).batch("train", 5), straight[5][1::5])
    n = again.split_length("train")  # whole epochs of samples, at least the run's 480
    train_docs = round(0.969 * len(corpus_documents(stdlib_corpus)))
    assert n >= 480 and n == (int(again.datasets[0].sequence_lengths[:train_docs].sum()) - 1) // 64
    with pytest.raises(DataError, match=rf"sample {n} of the train split: it has {n:,}"):
        Batches(again).batch("train", n // 12)


def test_blend_proportions_follow_the_weights(stdlib_byte, shakespeare_byte, tmp_path):
    cfg = run_cfg(f"0.3 {shakespeare_byte} 0.7 {stdlib_byte}", cache_dir=tmp_path, gb=16, iters=200)
    data = Data(cfg, str(tmp_path), splits=("train",))
    assert data.weights == [0.3, 0.7] and data.split_length("train") == 960 + 2240
    src = data.sample_source("train", np.arange(3200))
    for n in (1, 10, 333, 3200):  # Megatron's error-minimizing blend: every prefix within one sample of w x n
        counts = np.bincount(src[:n], minlength=2)
        assert np.all(np.abs(counts - np.array([0.3, 0.7]) * n) <= 1), (n, counts)
    # and the samples are those of the datasets: sample j of the blend is sample c of dataset d
    ix = data._index["train"]
    for j in (0, 1, 2, 500, 3199):
        d, c = int(ix["blend"][j]), int(ix["blend_sample"][j])
        assert c == int(np.sum(src[:j] == d))
        np.testing.assert_array_equal(data.sample("train", j), data._dataset_sample("train", d, c))


def test_unweighted_blend_and_file_list(stdlib_byte, shakespeare_byte, tmp_path):
    (tmp_path / "list.txt").write_text(f"# weight prefix corpus\n0.25 {stdlib_byte} code\n\n"
                                       f"0.75 {shakespeare_byte} plays  # the speeches\n")
    cfg = run_cfg("ignored when file_list is set", cache_dir=tmp_path, gb=8, iters=100,
                  file_list=str(tmp_path / "list.txt"))
    data = Data(cfg, str(tmp_path), splits=("train",))
    assert data.blend.corpora == ("code", "plays") and data.weights == [0.25, 0.75]
    out = tmp_path / "b.npy"
    r = cli("jaxllm.inspect_data", f"--config.data.file_list={tmp_path / 'list.txt'}",
            f"--config.data.cache_dir={tmp_path}",
            "--config.train.global_batch_size=8", "--config.train.micro_batch_size=8", "--config.train.train_iters=100",
            "--config.train.seq_length=64", f"--workdir={tmp_path}", "--steps=10:20", f"--output={out}")
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(np.load(out), np.stack([Batches(data).batch("train", s) for s in range(10, 20)]))
    share = {ln.split()[0]: ln.split()[1:] for ln in r.stdout.splitlines() if ln.startswith(("code", "plays"))}
    assert share == {"code": ["20", "0.2500", "0.2500"], "plays": ["60", "0.7500", "0.7500"]}, r.stdout
    assert "first row, decoded" in r.stdout
    # no weights: each dataset weighs its one epoch of samples (Megatron's blend of sizes)
    both = Data(run_cfg(f"{shakespeare_byte} {stdlib_byte}", cache_dir=tmp_path, gb=8, iters=100), str(tmp_path))
    lengths = [int(both._index["train"]["offsets"][i + 1, 2] - both._index["train"]["offsets"][i, 2]) for i in (0, 1)]
    assert both.weights is None and both.split_length("train") == 800
    counts = np.bincount(both.sample_source("train", np.arange(800)), minlength=2)
    assert np.all(np.abs(counts - 800 * np.array(lengths) / sum(lengths)) <= 1)


def test_uniform_windows_are_nanogpts(tmp_path):
    cfg = run_cfg(SHAKESPEARE, tokenizer="char", sampling="uniform", split="9,1", seq=64, gb=8, seed=7)
    data = Data(cfg, str(tmp_path))
    tokens = data.datasets[0].tokens
    n = len(tokens)
    assert data.tokenizer.name == "char" and n == 1115394
    x, y = Batches(data).train_batch(3)
    # the documented draw: offsets from default_rng([seed, 0, step]) over nanoGPT's first int(0.9 n) tokens
    offsets = np.random.default_rng([7, 0, 3]).integers(0, int(0.9 * n) - 64, size=8)
    for r, o in enumerate(offsets):
        np.testing.assert_array_equal(x[r], tokens[o:o + 64])
        np.testing.assert_array_equal(y[r], tokens[o + 1:o + 65])
    v = Batches(data).batch("valid", 0)
    offsets = int(0.9 * n) + np.random.default_rng([7, 1, 0]).integers(0, n - int(0.9 * n) - 64, size=8)
    np.testing.assert_array_equal(v, np.stack([tokens[o:o + 65] for o in offsets]))
    np.testing.assert_array_equal(Batches(data, rows=slice(2, 5)).batch("train", 3),
                                  Batches(data).batch("train", 3)[2:5])


def test_document_masks_reset_at_each_eod():
    eod = 9
    tokens = np.array([[1, 2, 9, 3, 4, 5, 9, 9, 6],
                       [9, 1, 2, 3, 4, 5, 6, 7, 8]])
    pos, seg, loss = document_masks(tokens, eod, True, True, True)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0], [0, 0, 1, 2, 3, 4, 5, 6, 7]]
    assert seg.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1, 1, 1]]
    assert loss.tolist() == [[1, 1, 0, 1, 1, 1, 0, 0, 1], [0, 1, 1, 1, 1, 1, 1, 1, 1]] and loss.dtype == np.float32
    pos, seg, loss = document_masks(tokens, eod, False, False, False)
    assert (pos == np.arange(9)).all() and (seg == 0).all() and (loss == 1).all()
    assert pos.dtype == seg.dtype == np.int32


def test_masks_of_a_run_and_options_needing_an_eod(shakespeare_gpt2, stdlib_byte, tmp_path):
    data = Data(run_cfg(shakespeare_gpt2, cache_dir=tmp_path, seq=128, reset_position_ids=True,
                        reset_attention_mask=True, eod_mask_loss=True), str(tmp_path))
    x, _, docs = Batches(data).train_batch(0)  # what the run's train step gets
    pos, seg, loss = docs["positions"], docs["segment_ids"], docs["loss_mask"]
    assert pos.shape == seg.shape == loss.shape == (8, 128)
    assert (x == 50256).sum() > 8  # speeches are short: several documents per row
    for r in range(8):  # positions count from each document's start; segments change after each EOD
        starts = np.r_[0, np.nonzero(x[r] == 50256)[0] + 1]
        starts = starts[starts < 128]
        doc_start = starts[np.searchsorted(starts, np.arange(128), "right") - 1]
        np.testing.assert_array_equal(pos[r], np.arange(128) - doc_start)
        np.testing.assert_array_equal(seg[r], np.searchsorted(starts, np.arange(128), "right") - 1)
        np.testing.assert_array_equal(loss[r], (x[r] != 50256).astype(np.float32))
    with pytest.raises(DataError, match="need an end-of-document token, and the byte tokenizer has none"):
        Data(run_cfg(stdlib_byte, cache_dir=tmp_path, reset_attention_mask=True), str(tmp_path))


def test_index_cache_is_keyed_and_built_once_across_processes(stdlib_byte, tmp_path):
    """Three processes start while the index's lock is held (as by a builder still at work): each says it
    waits; once the lock is gone, one builds and two read the same index."""
    cache, blend = tmp_path / "cache", f"0.5 {stdlib_byte} 0.5 {stdlib_byte}"
    cfg = run_cfg(blend, cache_dir=cache, iters=20)
    Data(run_cfg(blend, cache_dir=tmp_path / "probe", iters=20), str(tmp_path))  # the key: not the cache's path
    (key,) = os.listdir(tmp_path / "probe")
    cache.mkdir()
    lock = cache / f"{key}.lock"
    lock.write_text(f"{socket.gethostname()} {os.getpid()}\n")
    code = ("import sys, numpy as np; sys.path.insert(0, 'tests')\n"
            "from test_data import run_cfg; from jaxllm.data.loader import Data, Batches\n"
            f"d = Data(run_cfg({blend!r}, cache_dir={str(cache)!r}, iters=20), {str(tmp_path)!r})\n"
            "print('BUILT' if d.index_built else 'READ', Batches(d).batch('train', 19).sum())")
    errs = [tmp_path / f"stderr{i}" for i in range(3)]
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=e.open("w"),
                              text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}) for e in errs]
    deadline = time.monotonic() + 240
    while not all("waiting for another process to build" in e.read_text() for e in errs):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [e.read_text() for e in errs]
        time.sleep(0.2)
    lock.unlink()  # the "builder" gives up: the waiting processes race for the lock
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), [e.read_text() for e in errs]
    words = sorted(o.split()[0] for o in outs)
    assert words == ["BUILT", "READ", "READ"] and len({o.split()[1] for o in outs}) == 1, outs
    (key,) = [n for n in os.listdir(cache)]  # one directory, no lock or temporary left
    stamp = os.stat(cache / key / "train_shuffle.npy").st_mtime_ns
    assert not Data(cfg, str(tmp_path)).index_built and os.stat(cache / key / "train_shuffle.npy").st_mtime_ns == stamp
    cfg.train.seed = 1
    Data(cfg, str(tmp_path))
    cfg.train.train_iters = 30
    Data(cfg, str(tmp_path))
    assert len(os.listdir(cache)) == 3  # seed and sample counts are part of the key


def test_build_once_takes_over_a_dead_builders_lock(tmp_path):
    final = tmp_path / "thing"
    (tmp_path / "thing.lock").write_text("otherhost 4242\n")  # left by a process that died
    t0 = time.monotonic()
    assert build_once(str(final), lambda d: (Path(d) / "f").write_text("x"), what="a test", poll_s=0.05, stale_s=1.0)
    assert 1.0 <= time.monotonic() - t0 < 30 and (final / "f").read_text() == "x"
    assert sorted(os.listdir(tmp_path)) == ["thing"]

    def fail(d):
        (Path(d) / "partial").write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        build_once(str(tmp_path / "other"), fail, what="a test")
    assert sorted(os.listdir(tmp_path)) == ["thing"]  # nothing half-written, no lock left


def test_bad_inputs_are_one_data_error(stdlib_byte, stdlib_corpus, tmp_path):
    n = len(corpus_documents(stdlib_corpus))
    cases = [
        (run_cfg(f"0.5 {stdlib_byte} 0.5 {tmp_path / 'nothing'}"), r"nothing: no .*nothing.bin or .*nothing.idx"),
        (run_cfg(f"0.5 {stdlib_byte} -1 {stdlib_byte}"), r"weight -1.0 of .*: weights must be > 0"),
        (run_cfg(f"{stdlib_byte}.bin"),
         r"stdlib_byte.bin: name the indexed dataset by its prefix, .*stdlib_byte \(without"),
        (run_cfg(stdlib_byte, split="1,2,3,4"), r"data.split='1,2,3,4': give up to three"),
        (run_cfg(stdlib_byte, split="100,0,0"), r"leaves the valid split empty.*train.eval_interval=0"),
        (run_cfg(stdlib_byte, split="999999,1"),
         rf"the valid split of .* is sequences \[{n}, {n}\) of {n}, only 0 tokens"),
        (run_cfg(f"1 {stdlib_byte} 1 {stdlib_byte}", sampling="uniform"), r"uniform reads one dataset"),
        (run_cfg(stdlib_byte, sampling="random"), r"data.sampling='random': choose megatron or uniform"),
        (run_cfg(stdlib_byte, file_list=str(tmp_path / "missing.txt")), r"data.file_list=.*missing.txt: cannot read"),
        (run_cfg(stdlib_byte, cache_dir="/proc/no"), r"data.cache_dir='/proc/no': cannot write"),
        (run_cfg(SHAKESPEARE, tokenizer="char", sampling="uniform", split="99999,1", seq=64),
         r"the valid split of .* has 12 tokens, but train.seq_length=64 needs at least 65"),
    ]
    (tmp_path / "list.txt").write_text(f"0.5 {stdlib_byte} corpus extra\n")
    cases.append((run_cfg(stdlib_byte, file_list=str(tmp_path / "list.txt")),
                  r"list.txt:1: .*expected \"weight prefix corpus\""))
    for cfg, pattern in cases:
        with pytest.raises(DataError, match=pattern):
            Data(cfg, str(tmp_path))
    data = Data(run_cfg(stdlib_byte, tokenizer="byte", cache_dir=tmp_path), str(tmp_path))
    data.vocab_size = 100  # a tokenizer too small for the data
    with pytest.raises(DataError, match=r"holds token id 1\d\d, outside the byte tokenizer's vocabulary of 100"):
        Batches(data).batch("train", 0)
    r = cli("jaxllm.inspect_data", f"--config.data.input=0.5 {stdlib_byte} 0.5 {tmp_path / 'nothing'}",
            f"--workdir={tmp_path}", "--steps=0:2", f"--output={tmp_path / 'o.npy'}")
    assert "nothing.bin or" in one_error_line(r) and not (tmp_path / "o.npy").exists()
    r = cli("jaxllm.inspect_data", f"--workdir={tmp_path}", "--steps=2:2", f"--output={tmp_path / 'o.npy'}")
    assert "--steps='2:2': give A:B with 0 <= A < B" in one_error_line(r)
    with pytest.raises(DataError):
        parse_steps("1-3")


def test_megatron_data_without_meta_uses_data_tokenizer(shakespeare_gpt2, tmp_path):
    for s in (".bin", ".idx"):  # as Megatron's preprocess_data.py leaves it: no .meta.json
        (tmp_path / ("m" + s)).symlink_to(shakespeare_gpt2 + s)
    data = Data(run_cfg(tmp_path / "m", tokenizer="gpt2", cache_dir=tmp_path), str(tmp_path))
    assert data.tokenizer.name == "gpt2" and data.eod_id == 50256 and data.bytes_per_token is None
    byte = Data(run_cfg(tmp_path / "m", tokenizer="byte", cache_dir=tmp_path), str(tmp_path))
    with pytest.raises(DataError, match="outside the byte tokenizer's vocabulary of 256; set data.tokenizer"):
        Batches(byte).batch("train", 0)
    with pytest.raises(DataError, match="no .meta.json recording its characters"):
        Data(run_cfg(tmp_path / "m", tokenizer="char", cache_dir=tmp_path), str(tmp_path))


# --- ensure_prepared --------------------------------------------------------------------------------

def test_ensure_prepared_reuses_cache(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("print('hello')\n" * 100)
    (src / "b.txt").write_text("some text\n" * 100)
    cache = tmp_path / "cache"
    data_cfg = lambda **kw: run_cfg(src, **kw).data  # noqa: E731
    p1 = ensure_prepared(data_cfg(), str(cache))
    stamp = {s: os.stat(p1 + s).st_mtime_ns for s in (".bin", ".idx", ".meta.json")}
    assert ensure_prepared(data_cfg(), str(cache)) == p1
    assert stamp == {s: os.stat(p1 + s).st_mtime_ns for s in stamp}
    assert IndexedDataset(p1).num_tokens == 1500 + 1000 and IndexedDataset(p1).num_documents == 2
    # another tokenizer or marker, or changed sources -> another cache entry
    p_char = ensure_prepared(data_cfg(tokenizer="char"), str(cache))
    p_marker = ensure_prepared(data_cfg(document_marker="some"), str(cache))
    assert len({p1, p_char, p_marker}) == 3 and IndexedDataset(p_marker).num_documents == 1  # b.txt: all marker lines
    (src / "b.txt").write_text("changed\n")
    p3 = ensure_prepared(data_cfg(), str(cache))
    assert p3 != p1 and IndexedDataset(p3).num_tokens == 1500 + 8
    assert sorted(os.listdir(cache)) == sorted(os.path.basename(os.path.dirname(p)) for p in (p1, p3, p_char, p_marker))
    # a training config naming the text prepares it into WORKDIR/data
    data = Data(run_cfg(src, seq=16, gb=2, iters=5, sampling="uniform", split="1,1"), str(tmp_path / "run"))
    assert data.datasets[0].prefix.startswith(str(tmp_path / "run" / "data"))
    assert data.bytes_per_token == 1.0


def test_gpt2_files_changed_after_prepare(tmp_path):
    vocab = tmp_path / "gpt2"
    vocab.mkdir()
    for name in ("encoder.json", "vocab.bpe"):
        (vocab / name).write_bytes((GPT2_DIR / name).read_bytes())
    (tmp_path / "t.txt").write_text("Hello world. " * 50)
    meta = prepare([str(tmp_path / "t.txt")], "gpt2", str(tmp_path / "out"), gpt2_dir=str(vocab), progress=False)
    assert tokenizer_from_meta(meta).decode([15496]) == "Hello"
    with open(vocab / "vocab.bpe", "a") as f:
        f.write("x y\n")
    with pytest.raises(DataError, match=r"vocab.bpe changed since the data was prepared.*prepare the data again"):
        tokenizer_from_meta(read_meta(str(tmp_path / "out")))
    # the recorded directory gone (data prepared on another machine): the shipped files, whose checksums match
    for name in ("encoder.json", "vocab.bpe"):
        (vocab / name).unlink()
    assert tokenizer_from_meta(read_meta(str(tmp_path / "out"))).gpt2_dir == str(GPT2_DIR)
    # no gpt2_dir: the shipped files, the same ids and checksums as the given copy of them
    shipped = prepare([str(tmp_path / "t.txt")], "gpt2", str(tmp_path / "out2"), progress=False)
    assert shipped["gpt2_dir"] == str(GPT2_DIR) and shipped["gpt2_sha256"] == meta["gpt2_sha256"]
    np.testing.assert_array_equal(IndexedDataset(str(tmp_path / "out2")).tokens,
                                  IndexedDataset(str(tmp_path / "out")).tokens)
    with pytest.raises(DataError, match="encoder.json not found; set data.gpt2_dir"):
        prepare([str(tmp_path / "t.txt")], "gpt2", str(tmp_path / "out3"), gpt2_dir=str(vocab), progress=False)


def test_unigram_entropy():
    h = lambda *p: -sum(q * np.log(q) for q in p)  # noqa: E731
    assert unigram_entropy(np.array([[0, 0, 1], [0, 0, 1]]), 5) == pytest.approx(h(2 / 3, 1 / 3), rel=1e-12)
    assert unigram_entropy(np.arange(4), 4) == pytest.approx(np.log(4), rel=1e-12)


def test_document_marker_splits_text(tmp_path):
    (tmp_path / "t.txt").write_bytes(b"preamble\n== a\nA1\nA2\n== b\n== c\nC\n")
    docs = [t for t, _ in iter_documents(str(tmp_path / "t.txt"), document_marker="==")]
    assert docs == ["preamble\n", "A1\nA2\n", "C\n"]  # b: no line of its own, no document


def test_undecodable_bytes_of_the_default_corpus_are_said_without_advice(capsys, tmp_path):
    """The standard library holds its own tests of other encodings: the default corpus's bytes that do not decode are
    said in one quiet line, with no advice to re-encode a file of the Python installation; another input's get the
    advice."""
    from jaxllm.config import default_corpus
    from jaxllm.data.text import _check_decodable

    counts = {"replaced": 3, "chars": 1000, "nul": 0, "files": [os.path.join(default_corpus(), "test", "x.py")]}
    _check_decodable(default_corpus(), counts, 1.0)
    line = capsys.readouterr().err
    assert line == ("prepare: the default corpus (this Python's standard library) holds 3 bytes that do not decode as "
                    "UTF-8 (its tests of other encodings), read as U+FFFD\n"), line
    _check_decodable(str(tmp_path), {**counts, "files": [str(tmp_path / "notes.txt")]}, 1.0)
    assert "iconv -f latin1" in capsys.readouterr().err
