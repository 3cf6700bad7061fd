"""Tokenizers: round trips, separators, save/load."""

import numpy as np
import pytest

from phalanx.data.tokenize import BpeTokenizer, ByteTokenizer, load_tokenizer

TEXTS = ["def main():\n    print('héllo, wörld ✓')\n", "", "tabs\tand\r\nCRLF", "emoji 🐍 and 中文"]


def _loop_encode(tok, texts):
    out = []
    for t in texts:
        out.extend(tok.encode(t))
        out.append(tok.separator_id)
    return out


def test_bytes_round_trip_and_ids():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256 and tok.name == "bytes" and tok.separator_id == 0
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
    assert tok.encode_documents(TEXTS).tolist() == _loop_encode(tok, TEXTS)
    assert tok.encode_documents([]).tolist() == []


def test_bytes_decode_rejects_out_of_range_ids():
    with pytest.raises(ValueError, match=r"\[0, 255\]"):
        ByteTokenizer().decode([65, 300])


def test_bytes_decode_replaces_invalid_utf8():
    assert ByteTokenizer().decode([0xE2, 0x82]) == "\ufffd"


@pytest.fixture(scope="module")
def bpe():
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "import", "class", "value", "lambda", "for", "in", "range"]
    corpus = [" ".join(rng.choice(words, 40)) + "\n" for _ in range(200)]
    return BpeTokenizer.train(corpus, vocab_size=320)


def test_bpe_round_trip_and_merges(bpe):
    assert bpe.name == "bpe" and bpe.separator_id == 0
    assert 257 < bpe.vocab_size <= 320
    for text in TEXTS + ["unseen symbols: \x01 ÿ §"]:
        ids = bpe.encode(text)
        assert all(0 <= i < bpe.vocab_size for i in ids)
        assert bpe.decode(ids) == text
    # learnt merges make frequent words shorter than their bytes
    assert len(bpe.encode("return self")) < len("return self")
    assert bpe.encode_documents(TEXTS).tolist() == _loop_encode(bpe, TEXTS)


def test_bpe_separator_is_not_produced_by_text(bpe):
    assert 0 not in bpe.encode("<|sep|> looks like the token but is text")


def test_bpe_save_load(tmp_path, bpe):
    entry = bpe.save(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    loaded = load_tokenizer(tmp_path, entry)
    assert isinstance(loaded, BpeTokenizer) and loaded.vocab_size == bpe.vocab_size
    for text in TEXTS:
        assert loaded.encode(text) == bpe.encode(text)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path, {"name": "bpe", "file": "tokenizer.json"})
    with pytest.raises(ValueError, match="unknown tokenizer 'words'"):
        load_tokenizer(tmp_path, {"name": "words"})
    with pytest.raises(ValueError, match=">= 257"):
        BpeTokenizer.train(["abc"], vocab_size=100)
