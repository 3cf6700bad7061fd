"""Prepared datasets on disk: documents -> token ids -> fixed-length examples -> TFRecord shards.

Layout of a prepared directory::

    manifest.json             written last; a directory without it is not a dataset
    tokenizer.json            only for the BPE tokenizer
    train-00000-of-00008.tfrecord ...
    val-00000-of-00002.tfrecord ...

Each record is a ``tf.train.Example`` with one bytes feature ``tokens``: the
``seq_len + 1`` ids of one example, little-endian, in the smallest dtype that holds
the vocabulary (uint8 for bytes, uint16 for BPE up to 65536 ids). Example ``i`` of a
split goes to shard ``i % num_shards``, so a deterministic round-robin interleave of
the shards (:func:`read_split`) reads the examples back in their original order.

**Split.** Documents are cut into pieces of at most :func:`piece_chars` characters at
line boundaries; each piece goes to the validation split iff the hash of its name
(``path#k``) falls below ``val_fraction``. A piece is in exactly one split, so the
two splits never share text from the same place, and the choice does not depend on
the order or the content of the other files.

**Examples.** The pieces of a split are concatenated, each followed by the separator
id, and cut into windows of ``seq_len + 1`` ids with stride ``seq_len``: consecutive
examples share one id, so every id of the stream is a prediction target exactly once.
The tail shorter than a window is dropped.

**Atomic.** Everything is written into a hidden temporary sibling directory that is
renamed into place after ``manifest.json`` is complete: a process killed while
preparing never leaves a directory at the output path.

Example:
    >>> import tempfile
    >>> from phalanx.data.corpus import Corpus, Document
    >>> docs = Corpus([Document(f"f{i}.txt", f"text number {i}\\n" * 40) for i in range(30)])
    >>> out = tempfile.mkdtemp() + "/ds"
    >>> m = prepare_dataset(docs, out, tokenizer="bytes", seq_len=16, val_fraction=0.1, progress=False)
    >>> m.seq_len, m.tokenizer["name"], m.splits["train"]["examples"] > 0
    (16, 'bytes', True)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from phalanx.data.corpus import Corpus
from phalanx.data.tokenize import BpeTokenizer, ByteTokenizer, Tokenizer, load_tokenizer
from phalanx.fsutil import pid_alive

FORMAT = "phalanx-tokens/1"
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
MAX_PIECE_CHARS = 64 * 1024
BPE_TRAIN_BYTES = 8 * 1024 * 1024  # BPE merges are learnt on at most this much text


@dataclass(frozen=True)
class Manifest:
    """The parsed ``manifest.json`` of a prepared directory."""

    directory: Path
    seq_len: int
    dtype: str
    tokenizer: dict
    splits: dict
    source: dict
    raw: dict

    @property
    def fingerprint(self) -> str:
        """Identifies the exact examples (sha256 of the token streams of both splits)."""
        return self.raw["fingerprint"]

    def shard_paths(self, split: str) -> list[str]:
        return [str(self.directory / name) for name in self.splits[split]["shards"]]

    def load_tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.directory, self.tokenizer)


def read_manifest(directory: str | Path) -> Manifest:
    """Parse and check ``directory/manifest.json``; ``FileNotFoundError`` if absent."""
    directory = Path(directory)
    path = directory / MANIFEST
    raw = json.loads(path.read_text())
    if raw.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} has format {raw.get('format')!r}; this phalanx reads {FORMAT!r}")
    for split in SPLITS:
        for shard in raw["splits"][split]["shards"]:
            if not (directory / shard).is_file():
                raise FileNotFoundError(f"{str(path)!r} lists shard {shard!r}, which is missing")
    return Manifest(directory, int(raw["seq_len"]), raw["dtype"], raw["tokenizer"], raw["splits"], raw["source"], raw)


# ---------------------------------------------------------------------------
# Split and examples


def piece_chars(total_chars: int) -> int:
    """Piece size: at most 64 Ki characters, smaller for small corpora so that even a
    single file yields ~64 pieces to split between train and validation."""
    return int(min(MAX_PIECE_CHARS, max(256, total_chars // 64)))


def split_pieces(corpus: Corpus, val_fraction: float) -> dict[str, list[tuple[str, str]]]:
    """``{"train": [(piece name, text)...], "val": [...]}``, chosen by name hash."""
    size = piece_chars(sum(len(d.text) for d in corpus.documents))
    pieces = [(name, text, _unit_hash(name)) for doc in corpus.documents for name, text in _cut(doc.name, doc.text, size)]
    if len(pieces) < 2:
        raise ValueError(f"the corpus holds {len(pieces)} piece(s) of text; at least 2 are needed to hold out "
                         "a validation split (add text)")
    val = {p[0] for p in pieces if p[2] < val_fraction}
    if not val:  # tiny corpora: hold out the piece whose hash is lowest
        val = {min(pieces, key=lambda p: p[2])[0]}
    if len(val) == len(pieces):
        val.discard(max(pieces, key=lambda p: p[2])[0])
    return {
        "train": [(n, t) for n, t, _ in pieces if n not in val],
        "val": [(n, t) for n, t, _ in pieces if n in val],
    }


def _cut(name: str, text: str, size: int) -> Iterator[tuple[str, str]]:
    start, k = 0, 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            newline = text.rfind("\n", start, end)
            if newline > start:
                end = newline + 1
        yield f"{name}#{k}", text[start:end]
        start, k = end, k + 1


def _unit_hash(name: str) -> float:
    """Uniform in [0, 1): stable across runs, machines and Python's hash seed."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "little") / 2.0**64


def make_examples(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Windows of ``seq_len + 1`` ids with stride ``seq_len``; shape ``[n, seq_len + 1]``.

    >>> make_examples(np.arange(10), 3).tolist()
    [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    """
    n = (len(stream) - 1) // seq_len if len(stream) > 0 else 0
    if n <= 0:
        return np.zeros([0, seq_len + 1], dtype=stream.dtype)
    windows = np.lib.stride_tricks.sliding_window_view(stream[: n * seq_len + 1], seq_len + 1)
    return np.ascontiguousarray(windows[::seq_len])


def storage_dtype(vocab_size: int) -> str:
    return "uint8" if vocab_size <= 256 else "uint16" if vocab_size <= 65536 else "int32"


# ---------------------------------------------------------------------------
# Writing


def prepare_dataset(
    corpus: Corpus,
    output: str | Path,
    *,
    tokenizer: str | Tokenizer,
    seq_len: int,
    val_fraction: float,
    bpe_vocab: int = 4096,
    source: dict | None = None,
    num_shards: int | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    _after_shard: Callable[[int], None] | None = None,
) -> Manifest:
    """Tokenize ``corpus``, split it and write TFRecord shards + manifest to ``output``.

    ``tokenizer`` is ``"bytes"``, ``"bpe"`` (trained here on up to 8 MB of the training
    split) or a ready :class:`Tokenizer`. ``num_shards`` (default: up to 8) is the train
    shard count; validation gets up to 2. ``output`` must not exist unless it is an empty
    directory or ``overwrite`` is set. ``_after_shard`` is a test hook called after each
    shard is written.
    """
    output = Path(os.path.expanduser(str(output)))
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    _check_output(output, overwrite)
    import tensorflow  # noqa: F401  (imported before the clock starts: a one-off cost of the process)

    report = Reporter(progress)
    started = time.perf_counter()

    splits = split_pieces(corpus, val_fraction)
    tok = _build_tokenizer(tokenizer, splits["train"], bpe_vocab, report)
    dtype = storage_dtype(tok.vocab_size)

    examples: dict[str, np.ndarray] = {}
    stats: dict[str, dict] = {}
    for split in SPLITS:
        texts = [t for _, t in splits[split]]
        with report.stage(f"tokenizing {split} ({len(texts)} pieces)"):
            stream = tok.encode_documents(texts)
        examples[split] = make_examples(stream.astype(dtype), seq_len)
        stats[split] = {"pieces": len(texts), "tokens": int(len(stream)), "examples": int(len(examples[split]))}
        if len(examples[split]) == 0:
            raise ValueError(
                f"the {split} split has {len(stream)} tokens, fewer than seq_len + 1 = {seq_len + 1}: "
                f"use more text{' or a larger val_fraction' if split == 'val' else ''} or a smaller seq_len")

    fingerprint = hashlib.sha256()
    for split in SPLITS:
        fingerprint.update(split.encode() + examples[split].tobytes())

    _remove_stale_temps(output)
    with atomic_directory(output, overwrite) as tmp:
        tok_entry = tok.save(tmp)
        shard_counts = {"train": num_shards or 8, "val": 2}
        written = 0
        for split in SPLITS:
            arr = examples[split]
            n_shards = max(1, min(shard_counts[split], len(arr)))
            names = [f"{split}-{i:05d}-of-{n_shards:05d}.tfrecord" for i in range(n_shards)]
            with report.stage(f"writing {split}: {len(arr)} examples -> {n_shards} shards", total=n_shards) as bar:
                counts = []
                for i, name in enumerate(names):
                    counts.append(write_shard(tmp / name, arr[i::n_shards]))
                    written += 1
                    bar(1)
                    if _after_shard is not None:
                        _after_shard(written)
            stats[split].update(shards=names, shard_examples=counts)
        raw = {
            "format": FORMAT,
            "seq_len": seq_len,
            "dtype": dtype,
            "tokenizer": tok_entry,
            "val_fraction": val_fraction,
            "splits": stats,
            "source": {**(source or {}), "documents": len(corpus.documents), "bytes": corpus.num_bytes,
                       "skipped_files": corpus.skipped, "truncated": corpus.truncated},
            "fingerprint": fingerprint.hexdigest(),
            "prepare_seconds": round(time.perf_counter() - started, 3),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (tmp / MANIFEST).write_text(json.dumps(raw, indent=2) + "\n")
    report.line(f"prepared {output}: {corpus.num_bytes:,} bytes of text, {len(corpus.documents)} documents -> "
                f"{stats['train']['examples']:,} train / {stats['val']['examples']:,} val examples of "
                f"{seq_len + 1} {tok.name} tokens in {time.perf_counter() - started:.1f} s")
    return read_manifest(output)


def _build_tokenizer(tokenizer: str | Tokenizer, train_pieces: Sequence[tuple[str, str]], bpe_vocab: int,
                     report: "Reporter") -> Tokenizer:
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if tokenizer == "bytes":
        return ByteTokenizer()
    if tokenizer == "bpe":
        sample = _bpe_sample([t for _, t in train_pieces], BPE_TRAIN_BYTES)
        total = sum(len(t) for _, t in train_pieces)
        capped = sum(len(t) for t in sample)
        note = f" (a sample: {capped:,} of {total:,} characters)" if capped < total else ""
        with report.stage(f"training BPE, vocab {bpe_vocab}{note}"):
            return BpeTokenizer.train(sample, bpe_vocab)
    raise ValueError(f"unknown tokenizer {tokenizer!r}; choose bytes or bpe")


def _bpe_sample(texts: list[str], budget: int) -> list[str]:
    """Evenly spaced pieces totalling at most ``budget`` characters (all if they fit)."""
    total = sum(len(t) for t in texts)
    if total <= budget:
        return texts
    step = total / budget
    picked, acc, next_at = [], 0.0, 0.0
    for text in texts:
        if acc >= next_at:
            picked.append(text)
            next_at += step * len(text)
        acc += len(text)
    return picked


def write_shard(path: Path, examples: np.ndarray) -> int:
    """Write ``examples`` ([n, T+1], storage dtype) as one TFRecord file; returns n."""
    import tensorflow as tf

    little = examples.astype(examples.dtype.newbyteorder("<"), copy=False)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for row in little:
            feature = {"tokens": tf.train.Feature(bytes_list=tf.train.BytesList(value=[row.tobytes()]))}
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    return int(len(examples))


def _check_output(output: Path, overwrite: bool) -> None:
    if output.exists():
        if not output.is_dir():
            raise FileExistsError(f"output {str(output)!r} exists and is not a directory")
        if any(output.iterdir()) and not overwrite:
            what = "a prepared dataset" if (output / MANIFEST).exists() else "files"
            raise FileExistsError(f"output {str(output)!r} already holds {what}; choose another directory "
                                  "or overwrite it (--force)")


@contextlib.contextmanager
def atomic_directory(output: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces ``output`` in one rename.

    If another process completed ``output`` first (two workers preparing the same
    cache), that copy is kept and ours is discarded.
    """
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if output.exists() and output.is_dir() and not any(output.iterdir()):
            output.rmdir()
        old = None
        if output.exists() and overwrite:
            old = output.parent / f".{output.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.rename(output, old)
        try:
            os.rename(tmp, output)
        except OSError:
            if (output / MANIFEST).exists():  # lost a race to an identical prepare
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove_stale_temps(output: Path) -> None:
    """Delete temp dirs left by killed prepares of ``output`` (their pid is gone)."""
    if not output.parent.is_dir():
        return
    for entry in output.parent.glob(f".{output.name}.tmp-*"):
        pid = entry.name.rsplit(".tmp-", 1)[1].split("-")[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


# ---------------------------------------------------------------------------
# Reading


PARSE_BATCH = 1024  # records parsed per call: per-record parsing is ~15x slower


def read_split(manifest: Manifest, split: str):
    """``tf.data.Dataset`` of int32 ``[seq_len + 1]`` examples of ``split``, in written order.

    Shards are read with a deterministic interleave (one record from each shard in turn,
    which undoes the round-robin assignment) and parsed by a parallel map over small
    batches of records.
    """
    return _read_batches(manifest, split, PARSE_BATCH, "int32").unbatch()


def _read_batches(manifest: Manifest, split: str, batch: int, out_dtype: str):
    import tensorflow as tf

    paths = manifest.shard_paths(split)
    files = tf.data.Dataset.from_tensor_slices(paths)
    ds = files.interleave(tf.data.TFRecordDataset, cycle_length=len(paths), block_length=1,
                          num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    parse = batch_parser(manifest, out_dtype)
    return ds.batch(batch).map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def batch_parser(manifest: Manifest, out_dtype: str = "int32") -> Callable:
    """Function: vector of serialized ``tf.train.Example`` -> ``[n, seq_len + 1]`` ids."""
    import tensorflow as tf

    dtype = tf.as_dtype(manifest.dtype)
    length = manifest.seq_len + 1
    spec = {"tokens": tf.io.FixedLenFeature([], tf.string)}

    def parse(records):
        raw = tf.io.parse_example(records, spec)["tokens"]
        ids = tf.io.decode_raw(raw, dtype, little_endian=True)  # [n, length]; fails on a wrong length
        return tf.cast(tf.reshape(ids, [-1, length]), tf.as_dtype(out_dtype))

    return parse


def load_split_array(manifest: Manifest, split: str) -> np.ndarray:
    """All examples of ``split`` as a numpy array ``[n, seq_len + 1]`` in the storage dtype."""
    chunks = list(_read_batches(manifest, split, 8192, manifest.dtype).as_numpy_iterator())
    out = np.concatenate(chunks) if chunks else np.zeros([0, manifest.seq_len + 1], np.dtype(manifest.dtype))
    n = manifest.splits[split]["examples"]
    if len(out) != n:
        raise ValueError(f"{str(manifest.directory)!r}: the manifest says {n} {split} examples but the shards "
                         f"hold {len(out)}; prepare the data again")
    return out


# ---------------------------------------------------------------------------
# Progress


class Reporter:
    """Progress of a prepare: a rich bar on a terminal, plain stderr lines otherwise,
    nothing when ``enabled`` is False (``None``: on)."""

    def __init__(self, enabled: bool | None = None):
        self.enabled = enabled is not False
        self.rich = self.enabled and sys.stderr.isatty()

    def line(self, text: str) -> None:
        if self.enabled:
            print(f"[phalanx.data] {text}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def stage(self, label: str, total: int | None = None) -> Iterator[Callable[[int], None]]:
        started = time.perf_counter()
        if self.rich:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            columns = [TextColumn(r"\[phalanx.data] {task.description}"), BarColumn(), MofNCompleteColumn(),
                       TimeElapsedColumn()]
            with Progress(*columns, transient=True) as bar:
                task = bar.add_task(label, total=total)
                yield lambda n: bar.advance(task, n)
        else:
            yield lambda n: None
        self.line(f"{label}: {time.perf_counter() - started:.2f} s")
