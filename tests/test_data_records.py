"""Prepared datasets: split, examples, TFRecord round trip, atomic writes."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from phalanx.data import records
from phalanx.data.corpus import Corpus, Document, glob_files, glob_root, read_documents
from phalanx.data.tokenize import ByteTokenizer


def random_corpus(n_docs=40, lines=12, seed=0):
    """Documents of random words, each line tagged with a unique marker."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    docs = []
    for d in range(n_docs):
        body = "".join(f"<m{d}.{i}> " + "".join(rng.choice(letters, 30)) + "\n" for i in range(lines))
        docs.append(Document(f"doc{d:03d}.txt", body))
    return Corpus(docs)


def test_make_examples_cover_stream_with_one_shared_token():
    stream = np.arange(100)
    ex = records.make_examples(stream, 8)
    assert ex.shape == (12, 9)
    assert (ex[1:, 0] == ex[:-1, -1]).all()  # stride seq_len: neighbours share one id
    assert np.concatenate([ex[:, :-1].ravel(), ex[-1:, -1]]).tolist() == list(range(97))
    assert records.make_examples(np.arange(5), 8).shape == (0, 9)


def test_split_is_disjoint_deterministic_and_near_fraction():
    corpus = random_corpus(n_docs=200, lines=4)
    a = records.split_pieces(corpus, 0.2)
    b = records.split_pieces(corpus, 0.2)
    assert a == b
    train, val = {n for n, _ in a["train"]}, {n for n, _ in a["val"]}
    assert not train & val and len(train) + len(val) >= 200
    assert 0.1 < len(val) / (len(train) + len(val)) < 0.3
    # the split of a piece depends only on its name, not on the other files
    fewer = records.split_pieces(Corpus(corpus.documents[:100]), 0.2)
    assert {n for n, _ in fewer["val"]} == {n for n in val if int(n[3:6]) < 100}


def test_split_errors_and_small_corpora():
    with pytest.raises(ValueError, match="at least 2"):
        records.split_pieces(Corpus([Document("a", "x")]), 0.1)
    tiny = records.split_pieces(Corpus([Document("a", "x\n" * 10), Document("b", "y\n" * 10)]), 0.01)
    assert len(tiny["val"]) == 1 and len(tiny["train"]) == 1


def test_tfrecord_round_trip(tmp_path):
    corpus = random_corpus()
    manifest = records.prepare_dataset(corpus, tmp_path / "ds", tokenizer="bytes", seq_len=16, val_fraction=0.2,
                                       num_shards=3, progress=False)
    assert manifest.dtype == "uint8" and len(manifest.splits["train"]["shards"]) == 3
    pieces = records.split_pieces(corpus, 0.2)
    tok = ByteTokenizer()
    for split in ("train", "val"):
        expected = records.make_examples(tok.encode_documents([t for _, t in pieces[split]]), 16)
        got = records.load_split_array(manifest, split)
        np.testing.assert_array_equal(got, expected)
        streamed = np.stack([x.numpy() for x in records.read_split(manifest, split)])
        assert streamed.dtype == np.int32
        np.testing.assert_array_equal(streamed, expected)
        assert sum(manifest.splits[split]["shard_examples"]) == len(expected) == manifest.splits[split]["examples"]


def test_val_text_never_in_train(tmp_path):
    manifest = records.prepare_dataset(random_corpus(), tmp_path / "ds", tokenizer="bytes", seq_len=16,
                                       val_fraction=0.2, progress=False)
    tok = manifest.load_tokenizer()

    def markers(split):
        arr = records.load_split_array(manifest, split)
        text = tok.decode(np.concatenate([arr[:, :-1].ravel(), arr[-1, -1:]]))
        return set(s.split(">")[0] for s in text.split("<m")[1:] if ">" in s)

    train, val = markers("train"), markers("val")
    assert val and train and not train & val


def test_manifest_contents(tmp_path):
    m = records.prepare_dataset(random_corpus(), tmp_path / "ds", tokenizer="bytes", seq_len=16, val_fraction=0.2,
                                source={"kind": "test"}, progress=False)
    raw = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert raw["format"] == records.FORMAT and raw["seq_len"] == 16
    assert raw["tokenizer"] == {"name": "bytes", "vocab_size": 256, "separator_id": 0}
    assert raw["source"]["kind"] == "test" and raw["source"]["documents"] == 40
    assert len(raw["fingerprint"]) == 64 and m.fingerprint == raw["fingerprint"]


def test_prepare_bpe(tmp_path):
    m = records.prepare_dataset(random_corpus(), tmp_path / "ds", tokenizer="bpe", bpe_vocab=300, seq_len=16,
                                val_fraction=0.2, progress=False)
    assert m.dtype == "uint16" and (tmp_path / "ds" / "tokenizer.json").is_file()
    tok = m.load_tokenizer()
    assert tok.name == "bpe" and 256 < tok.vocab_size <= 300
    arr = records.load_split_array(m, "train")
    assert arr.max() < tok.vocab_size
    assert "<m" in tok.decode(arr[0])


def test_prepare_refuses_existing_output_and_replaces_with_overwrite(tmp_path):
    out = tmp_path / "ds"
    first = records.prepare_dataset(random_corpus(seed=1), out, tokenizer="bytes", seq_len=16, val_fraction=0.2,
                                    progress=False)
    with pytest.raises(FileExistsError, match="already holds a prepared dataset"):
        records.prepare_dataset(random_corpus(seed=2), out, tokenizer="bytes", seq_len=16, val_fraction=0.2,
                                progress=False)
    second = records.prepare_dataset(random_corpus(seed=2), out, tokenizer="bytes", seq_len=16, val_fraction=0.2,
                                     overwrite=True, progress=False)
    assert second.fingerprint != first.fingerprint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # no temp or old dirs left
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="already holds files"):
        records.prepare_dataset(random_corpus(), other, tokenizer="bytes", seq_len=16, val_fraction=0.2,
                                progress=False)


def test_prepare_value_errors(tmp_path):
    with pytest.raises(ValueError, match="fewer than seq_len"):
        records.prepare_dataset(random_corpus(n_docs=3, lines=1), tmp_path / "a", tokenizer="bytes", seq_len=4096,
                                val_fraction=0.2, progress=False)
    with pytest.raises(ValueError, match="val_fraction"):
        records.prepare_dataset(random_corpus(), tmp_path / "b", tokenizer="bytes", seq_len=16, val_fraction=1.5,
                                progress=False)
    with pytest.raises(ValueError, match="unknown tokenizer"):
        records.prepare_dataset(random_corpus(), tmp_path / "c", tokenizer="words", seq_len=16, val_fraction=0.2,
                                progress=False)
    assert not any(tmp_path.iterdir())


def test_failure_mid_write_leaves_nothing(tmp_path):
    def boom(n):
        if n == 2:
            raise RuntimeError("simulated failure")

    with pytest.raises(RuntimeError, match="simulated"):
        records.prepare_dataset(random_corpus(), tmp_path / "ds", tokenizer="bytes", seq_len=16, val_fraction=0.2,
                                num_shards=4, progress=False, _after_shard=boom)
    assert list(tmp_path.iterdir()) == []


def test_killed_prepare_leaves_no_dataset_and_is_cleaned_up(tmp_path):
    # A real kill: the process exits mid-write without running any cleanup.
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_data_records import random_corpus
        from phalanx.data import records
        records.prepare_dataset(random_corpus(), {str(tmp_path / "ds")!r}, tokenizer="bytes", seq_len=16,
                                val_fraction=0.2, num_shards=4, progress=False,
                                _after_shard=lambda n: os._exit(9) if n == 2 else None)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    leftovers = list(tmp_path.iterdir())
    assert not (tmp_path / "ds").exists()
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".ds.tmp-")
    assert not (leftovers[0] / "manifest.json").exists()
    # the next prepare succeeds and removes the dead process's temp dir
    records.prepare_dataset(random_corpus(), tmp_path / "ds", tokenizer="bytes", seq_len=16, val_fraction=0.2,
                            progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_read_manifest_detects_missing_shard(tmp_path):
    m = records.prepare_dataset(random_corpus(), tmp_path / "ds", tokenizer="bytes", seq_len=16, val_fraction=0.2,
                                progress=False)
    os.remove(m.shard_paths("train")[0])
    with pytest.raises(FileNotFoundError, match="missing"):
        records.read_manifest(tmp_path / "ds")


def test_corpus_reading(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha\x00beta\n")
    (tmp_path / "sub" / "b.txt").write_text("gamma " * 100)
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe latin")
    files = glob_files(str(tmp_path / "**" / "*.txt"))
    assert [f.name for f in files] == ["a.txt", "bad.txt", "b.txt"]
    assert glob_root(str(tmp_path / "**" / "*.txt")) == tmp_path
    corpus = read_documents(files, tmp_path)
    assert [d.name for d in corpus.documents] == ["a.txt", "sub/b.txt"]
    assert corpus.documents[0].text == "alphabeta\n"  # NUL removed: id 0 is the separator
    assert corpus.skipped == ["bad.txt"] and not corpus.truncated
    capped = read_documents(files, tmp_path, max_bytes=50)
    assert capped.truncated and capped.num_bytes == 50
