"""`phalanx data prepare | inspect` (phalanx.data.cli.main)."""

import numpy as np

from phalanx.data import records
from phalanx.data.cli import main


def corpus(tmp_path, n=20):
    d = tmp_path / "corpus"
    d.mkdir()
    rng = np.random.default_rng(0)
    for i in range(n):
        (d / f"{i}.txt").write_text("".join(f"line {i}.{j} {rng.integers(1e9)}\n" for j in range(15)))
    return str(d / "*.txt")


def test_prepare_then_inspect(tmp_path, capsys):
    glob = corpus(tmp_path)
    out = tmp_path / "data"
    assert main(["prepare", "--input", glob, "--output", str(out), "--tokenizer", "bytes", "--seq-len", "32",
                 "--val-fraction", "0.1", "--shards", "3"]) == 0
    captured = capsys.readouterr()
    assert "train " in captured.out and "3 shards" in captured.out
    assert "[phalanx.data] prepared" in captured.err  # plain progress lines when not on a terminal
    m = records.read_manifest(out)
    assert m.seq_len == 32 and m.source["kind"] == "glob" and m.source["files"] == 20
    assert main(["inspect", str(out), "--samples", "2", "--chars", "50"]) == 0
    shown = capsys.readouterr().out
    assert "tokenizer   bytes (vocab 256" in shown and shown.count("--- train example") == 2
    assert "line " in shown


def test_prepare_bpe_quiet(tmp_path, capsys):
    out = tmp_path / "bpe"
    assert main(["prepare", "--input", corpus(tmp_path), "--output", str(out), "--tokenizer", "bpe",
                 "--bpe-vocab", "300", "--seq-len", "16", "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")
    assert records.read_manifest(out).tokenizer["name"] == "bpe"


def test_prepare_errors_exit_2(tmp_path, capsys):
    glob = corpus(tmp_path)
    assert main(["prepare", "--input", str(tmp_path / "none*.txt"), "--output", str(tmp_path / "o")]) == 2
    assert "error: --input: no file matches" in capsys.readouterr().err
    assert main(["prepare", "--input", glob, "--output", str(tmp_path / "o"), "--seq-len", "0"]) == 2
    assert "error: --seq-len: must be >= 1, got 0" in capsys.readouterr().err
    assert main(["prepare", "--input", glob, "--output", str(tmp_path / "o"), "--val-fraction", "1"]) == 2
    assert "error: --val-fraction" in capsys.readouterr().err
    assert main(["prepare", "--input", glob, "--output", str(tmp_path / "o"), "--seq-len", "100000"]) == 2
    assert "error: --input: the train split has" in capsys.readouterr().err
    small = ["--seq-len", "16", "--quiet"]
    assert main(["prepare", "--input", glob, "--output", str(tmp_path / "o"), *small]) == 0
    assert main(["prepare", "--input", glob, "--output", str(tmp_path / "o"), *small]) == 2
    err = capsys.readouterr().err
    assert "error: --output:" in err and "already holds a prepared dataset" in err and "--force" in err
    assert main(["prepare", "--input", glob, "--output", str(tmp_path / "o"), *small, "--force"]) == 0


def test_inspect_errors_exit_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "error: data.source:" in capsys.readouterr().err
