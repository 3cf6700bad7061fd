"""``phalanx data``: prepare text into TFRecord shards, inspect a prepared directory.

Example:
    phalanx data prepare --input 'corpus/*.txt' --output data/ --tokenizer bytes --seq-len 128
    phalanx data prepare --input stdlib --output data/stdlib-bpe --tokenizer bpe --bpe-vocab 4096
    phalanx data inspect data/

Then train on it with ``phalanx train data.source=data/`` (``model.seq_len`` and
``data.tokenizer`` must match what was prepared).

    >>> main(["inspect", "/nonexistent"])
    2
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from phalanx.config import ConfigError, DataConfig, ModelConfig
from phalanx.data import corpus as corpus_lib, records

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    data_defaults, model_defaults = DataConfig(), ModelConfig()
    parser = argparse.ArgumentParser(prog="phalanx data", description="Prepare and inspect training data.")
    sub = parser.add_subparsers(dest="command", required=True)

    prep = sub.add_parser("prepare", help="tokenize text files into TFRecord shards with a manifest")
    prep.add_argument("--input", required=True,
                      help="glob of text files (quote it: 'corpus/**/*.txt'), or 'stdlib' for the Python "
                           "standard library's own sources")
    prep.add_argument("--output", required=True, help="directory to create (must not exist or be empty)")
    prep.add_argument("--tokenizer", choices=("bytes", "bpe"), default=data_defaults.tokenizer)
    prep.add_argument("--seq-len", type=int, default=model_defaults.seq_len,
                      help=f"tokens per example (model.seq_len; default {model_defaults.seq_len})")
    prep.add_argument("--val-fraction", type=float, default=data_defaults.val_fraction,
                      help=f"share of the text held out for validation (default {data_defaults.val_fraction})")
    prep.add_argument("--bpe-vocab", type=int, default=data_defaults.bpe_vocab,
                      help=f"BPE vocabulary size (default {data_defaults.bpe_vocab})")
    prep.add_argument("--max-bytes", type=int, default=0, help="read at most this many bytes of text (0: all)")
    prep.add_argument("--shards", type=int, default=None, help="number of training shards (default: up to 8)")
    prep.add_argument("--force", action="store_true", help="replace an existing prepared dataset at --output")
    prep.add_argument("--quiet", action="store_true", help="no progress output")

    insp = sub.add_parser("inspect", help="show the counts of a prepared directory and decoded samples")
    insp.add_argument("directory")
    insp.add_argument("--samples", type=int, default=1, help="training examples to decode (default 1)")
    insp.add_argument("--chars", type=int, default=400, help="characters shown per sample (default 400)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    try:
        if args.command == "prepare":
            return _prepare(args)
        return _inspect(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE


def _prepare(args: argparse.Namespace) -> int:

    for flag, ok, need in (("--seq-len", args.seq_len >= 1, ">= 1"),
                           ("--val-fraction", 0.0 < args.val_fraction < 1.0, "in (0, 1)"),
                           ("--bpe-vocab", args.bpe_vocab >= 257, ">= 257"),
                           ("--max-bytes", args.max_bytes >= 0, ">= 0"),
                           ("--shards", args.shards is None or args.shards >= 1, ">= 1")):
        if not ok:
            raise ConfigError(flag, f"must be {need}, got {getattr(args, flag[2:].replace('-', '_'))}")
    if args.input == "stdlib":
        root = corpus_lib.stdlib_root()
        files = corpus_lib.stdlib_files(root)
    else:
        files = corpus_lib.glob_files(args.input)
        root = corpus_lib.glob_root(args.input)
        if not files:
            raise ConfigError("--input", f"no file matches {args.input!r}; give a glob of text files such as "
                                         "'corpus/*.txt' (quoted) or 'stdlib'")
    corpus = corpus_lib.read_documents(files, root, args.max_bytes)
    source = {"kind": "stdlib" if args.input == "stdlib" else "glob", "spec": args.input, "root": str(root),
              "files": len(files), "files_fingerprint": corpus_lib.files_fingerprint(files, root),
              "max_bytes": args.max_bytes}
    try:
        manifest = records.prepare_dataset(
            corpus, args.output, tokenizer=args.tokenizer, seq_len=args.seq_len, val_fraction=args.val_fraction,
            bpe_vocab=args.bpe_vocab, source=source, num_shards=args.shards, overwrite=args.force,
            progress=False if args.quiet else None)
    except FileExistsError as err:
        raise ConfigError("--output", str(err)) from None
    except ValueError as err:
        raise ConfigError("--input", str(err)) from None
    if not args.quiet:
        print(_summary(manifest))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from pathlib import Path


    directory = Path(args.directory)
    if not (directory / records.MANIFEST).is_file():
        raise ConfigError("data.source", f"{args.directory!r} holds no {records.MANIFEST}: not a prepared dataset "
                                         "(make one with `phalanx data prepare`)")
    try:
        manifest = records.read_manifest(directory)
    except (ValueError, FileNotFoundError, KeyError, json.JSONDecodeError) as err:
        raise ConfigError("data.source", f"{args.directory!r} is not a usable prepared dataset: {err}") from None
    print(_summary(manifest))
    tokenizer = manifest.load_tokenizer()
    for i, example in enumerate(records.read_split(manifest, "train").take(max(0, args.samples))):
        text = tokenizer.decode(example.numpy().tolist())
        shown = text[: args.chars] + ("..." if len(text) > args.chars else "")
        print(f"--- train example {i} ({manifest.seq_len + 1} tokens) ---")
        print(shown)
    return 0


def _summary(manifest) -> str:
    m, s = manifest, manifest.splits
    tok = m.tokenizer
    lines = [
        f"dataset     {m.directory}",
        f"tokenizer   {tok['name']} (vocab {tok['vocab_size']}, separator id {tok['separator_id']})",
        f"seq_len     {m.seq_len} (+1 per example: inputs [:-1], targets [1:]), stored as {m.dtype}",
        f"source      {m.source.get('kind', '?')} {m.source.get('spec', '')}: {m.source.get('documents', '?')} "
        f"documents, {m.source.get('bytes', 0):,} bytes"
        + (" (truncated by max_bytes)" if m.source.get("truncated") else ""),
    ]
    for split in ("train", "val"):
        lines.append(f"{split:<11} {s[split]['examples']:,} examples, {s[split]['tokens']:,} tokens, "
                     f"{s[split]['pieces']} pieces, {len(s[split]['shards'])} shards")
    lines.append(f"fingerprint {m.fingerprint[:16]}  prepared in {m.raw.get('prepare_seconds', '?')} s")
    return "\n".join(lines)
