"""tf.data input for training and evaluation: :func:`make_datasets`.

``cfg.data.source`` is one of

* ``stdlib``: the interpreter's own standard library (see :mod:`phalanx.data.corpus`),
  prepared once per (Python version, file list, tokenizer, seq_len, val_fraction,
  max_bytes, bpe_vocab) under ``cfg.data.cache_dir/data/`` and reused after that;
* a directory holding a prepared dataset (``manifest.json``, from ``phalanx data prepare``);
* a glob of text files (``'corpus/**/*.txt'``), prepared into the same cache, keyed by
  the file names, sizes and modification times.

**Training stream: an index-level design.** The training examples are read from
the shards once (deterministic interleave + parallel parse, as :func:`records.read_split`)
and held in memory, which is what ``cache()`` would do. Global batch ``k`` holds the
examples at stream positions ``k*G .. k*G+G-1`` (``G = train.global_batch``); position
``p`` belongs to epoch ``p // N`` and maps to example ``perm_e(p % N)``, where ``perm_e``
is a full random permutation of the ``N`` training examples drawn from
``(train.seed, e)`` by TensorFlow's stateless ``RandomIndexShuffle``. Hence

* batch ``k`` depends only on the prepared data, ``G`` and ``train.seed``: never on
  dp/tp/pp or on the number of workers; worker ``w`` of ``W`` computes only its rows
  ``[w*b, (w+1)*b)`` with ``b = G / W``, so the workers together see every example
  exactly once per epoch;
* the iterator position is one integer, the step: a resumed iterator starts at step
  ``k`` at once and yields exactly what the uninterrupted one would. (Checkpointing a
  ``cache().shuffle().repeat()`` iterator with ``tf.train.Checkpoint`` instead stores the
  whole cache plus the shuffle buffer: 39 MB for a 26 MB dataset, measured.)
* every epoch is a true permutation, not a windowed shuffle, so ``data.shuffle_buffer``
  is not needed by the training stream.

Validation is the plain pipeline: interleave -> map(parse) -> cache -> batch(G,
drop_remainder) -> this worker's rows -> prefetch; finite and in file order.

Example:
    >>> from phalanx.config import load_config
    >>> cfg = load_config(None, ["data.max_bytes=200000", "model.seq_len=64"])
    >>> ds = make_datasets(cfg, progress=False)
    >>> batch = next(iter(ds.train))
    >>> batch.shape.as_list(), batch.dtype.name
    ([16, 65], 'int32')
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np

from phalanx.config import Config, ConfigError
from phalanx.data import corpus as corpus_lib
from phalanx.data.checks import check_token_ids
from phalanx.data import records
from phalanx.data.records import MANIFEST, Manifest
from phalanx.data.tokenize import Tokenizer

if TYPE_CHECKING:  # TensorFlow is imported lazily: `phalanx data inspect` and config checks stay quick
    import tensorflow as tf

ITERATOR_FILE = "data_iterator.json"
_INFINITE = 2**62  # steps; Dataset.range needs a bound


@dataclass(frozen=True)
class Datasets:
    """What :func:`make_datasets` returns.

    ``train``: infinite ``tf.data.Dataset`` of int32 ``[batch_size, seq_len + 1]`` starting
    at step 0 (use :meth:`train_from` / :meth:`train_iterator` to start elsewhere).
    ``val``: finite, ``val_batches`` batches of the same shape.
    """

    train: "tf.data.Dataset"
    val: "tf.data.Dataset"
    tokenizer: Tokenizer
    vocab_size: int
    manifest: Manifest
    global_batch: int
    batch_size: int  # rows per worker
    worker_index: int
    num_workers: int
    seed: int
    num_train_examples: int
    num_val_examples: int
    val_batches: int
    _examples: "tf.Tensor"  # [N, T+1] training examples, storage dtype, on the host CPU

    @property
    def directory(self) -> Path:
        return self.manifest.directory

    @property
    def steps_per_epoch(self) -> float:
        return self.num_train_examples / self.global_batch

    def train_from(self, step: int) -> "tf.data.Dataset":
        """The training stream starting at global batch ``step``."""
        return _train_stream(self._examples, self.seed, self.global_batch,
                             self.worker_index * self.batch_size, self.batch_size, step)

    def train_iterator(self, step: int = 0) -> "TrainIterator":
        """An iterator over the training stream that counts its position (for checkpoints)."""
        return TrainIterator(self, step)

    def global_batch_at(self, step: int) -> np.ndarray:
        """Example indices of global batch ``step`` (all workers), for inspection and tests."""
        positions = np.arange(step * self.global_batch, (step + 1) * self.global_batch, dtype=np.int64)
        return _shuffled_indices(positions, self.num_train_examples, self.seed).numpy()


def _train_stream(examples, seed: int, global_batch: int, offset: int, batch_size: int, start: int):
    """Batches ``start, start+1, ...``: rows ``[offset, offset+batch_size)`` of each global batch."""
    import tensorflow as tf

    if start < 0:
        raise ValueError(f"step must be >= 0, got {start}")
    n = int(examples.shape[0])
    rows = tf.range(batch_size, dtype=tf.int64)

    def batch_at(step):
        indices = _shuffled_indices(step * global_batch + offset + rows, n, seed)
        return tf.cast(tf.gather(examples, indices), tf.int32)

    steps = tf.data.Dataset.range(start, _INFINITE)
    ds = steps.map(batch_at, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.prefetch(tf.data.AUTOTUNE).with_options(_options())


def _shuffled_indices(positions, n: int, seed: int):
    """Example index at each stream position: epoch ``p // n``, permuted by (seed, epoch)."""
    import tensorflow as tf

    positions = tf.convert_to_tensor(positions, tf.int64)
    epoch = positions // n
    seeds = tf.stack([tf.fill(tf.shape(epoch), tf.constant(seed, tf.int64)), epoch, tf.zeros_like(epoch)], axis=1)
    # The raw op: the Python wrapper of index_shuffle mishandles per-element seed matrices (TF 2.21).
    return tf.raw_ops.RandomIndexShuffle(index=positions % n, seed=seeds,
                                         max_index=tf.constant(n - 1, tf.int64), rounds=4)


def _options():
    import tensorflow as tf

    options = tf.data.Options()
    options.deterministic = True
    # Sharding is ours (rows of the global batch); tf.distribute must not shard again.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return options


class TrainIterator:
    """Iterates the training stream and knows its position (``step`` = batches consumed).

    >>> from phalanx.config import load_config
    >>> ds = make_datasets(load_config(None, ["data.max_bytes=100000", "model.seq_len=32"]), progress=False)
    >>> it = ds.train_iterator()
    >>> _ = next(it); _ = next(it)
    >>> it.step
    2
    """

    def __init__(self, datasets: Datasets, step: int = 0):
        self.datasets = datasets
        self.step = int(step)
        self._it = iter(datasets.train_from(self.step))

    def __iter__(self) -> "TrainIterator":
        return self

    def __next__(self):
        batch = next(self._it)
        self.step += 1
        return batch

    def state_dict(self) -> dict[str, object]:
        """The position and what it refers to; see :func:`save_iterator`."""
        d = self.datasets
        return {"step": self.step, "global_batch": d.global_batch, "seed": d.seed,
                "dataset": d.manifest.fingerprint, "num_examples": d.num_train_examples}


def save_iterator(iterator: TrainIterator, directory: str | Path) -> Path:
    """Write the iterator position to ``directory/data_iterator.json`` (atomically).

    A few hundred bytes whatever the dataset size: the position is the step.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ITERATOR_FILE
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{ITERATOR_FILE}.")
    with os.fdopen(fd, "w") as f:
        json.dump(iterator.state_dict(), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def restore_iterator(datasets: Datasets, directory: str | Path) -> TrainIterator:
    """A :class:`TrainIterator` at the position saved in ``directory`` by :func:`save_iterator`.

    Raises ``FileNotFoundError`` if none was saved, and :class:`ConfigError` if the
    position was saved for other data, another global batch or another seed: step
    ``k`` would then name other examples, and the resumed run would repeat some and
    skip others.
    """
    path = Path(directory) / ITERATOR_FILE
    state = json.loads(path.read_text())
    checks = (("global_batch", "train.global_batch", datasets.global_batch),
              ("seed", "train.seed", datasets.seed),
              ("dataset", "data.source", datasets.manifest.fingerprint))
    for field, key, now in checks:
        if state.get(field) != now:
            raise ConfigError(key, f"the data position in {str(path)!r} was saved with {field} {state.get(field)!r}, "
                                   f"the run now has {now!r}; resume with the same setting or start a new run.dir")
    return TrainIterator(datasets, int(state["step"]))


# ---------------------------------------------------------------------------
# Building


def make_datasets(cfg: Config, worker_index: int = 0, num_workers: int = 1, *,
                  progress: bool | None = None) -> Datasets:
    """Training and validation datasets for worker ``worker_index`` of ``num_workers``.

    Prepares (or finds in the cache) the data named by ``cfg.data.source``; see the
    module docstring. Errors in the source are :class:`ConfigError` on ``data.source``.
    """
    import tensorflow as tf

    global_batch = cfg.train.global_batch
    if num_workers < 1 or not 0 <= worker_index < num_workers:
        raise ValueError(f"worker_index must be in [0, num_workers); got {worker_index} of {num_workers}")
    if global_batch % num_workers:
        raise ConfigError("train.global_batch", f"{global_batch} is not divisible by the {num_workers} workers; "
                                                f"use a multiple of {num_workers}")
    manifest = resolve_source(cfg, progress=progress)
    tokenizer = manifest.load_tokenizer()
    check_compatible(cfg, manifest, tokenizer)

    batch_size = global_batch // num_workers
    train_array = records.load_split_array(manifest, "train")
    check_ids(cfg, manifest, "train", train_array)
    check_ids(cfg, manifest, "val", records.load_split_array(manifest, "val"))
    with tf.device("/cpu:0"):
        examples = tf.constant(train_array)
    n_val = manifest.splits["val"]["examples"]
    val, val_batches = _val_dataset(manifest, global_batch, worker_index, batch_size)
    train = _train_stream(examples, cfg.train.seed, global_batch, worker_index * batch_size, batch_size, 0)
    return Datasets(
        train=train, val=val, tokenizer=tokenizer, vocab_size=tokenizer.vocab_size, manifest=manifest,
        global_batch=global_batch, batch_size=batch_size, worker_index=worker_index, num_workers=num_workers,
        seed=cfg.train.seed, num_train_examples=int(examples.shape[0]), num_val_examples=n_val,
        val_batches=val_batches, _examples=examples)


def _val_dataset(manifest: Manifest, global_batch: int, worker_index: int, batch_size: int):
    """Finite validation batches: every val example once if there are at least
    ``global_batch`` of them (the remainder dropped), else one batch that repeats them."""
    import tensorflow as tf

    n = manifest.splits["val"]["examples"]
    ds = records.read_split(manifest, "val")
    if n >= global_batch:
        n_batches = n // global_batch
        ds = ds.take(n_batches * global_batch).cache()
    else:
        n_batches = 1
        ds = ds.cache().repeat(-(-global_batch // n)).take(global_batch)
    ds = ds.batch(global_batch, drop_remainder=True)
    start = worker_index * batch_size
    ds = ds.map(lambda x: x[start:start + batch_size], num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.prefetch(tf.data.AUTOTUNE).with_options(_options()), n_batches


def check_compatible(cfg: Config, manifest: Manifest, tokenizer: Tokenizer) -> None:
    """The prepared data must match the model: same seq_len and tokenizer, vocab big enough."""
    where = str(manifest.directory)
    if manifest.seq_len != cfg.model.seq_len:
        raise ConfigError("data.source", f"{where!r} was prepared with seq_len {manifest.seq_len} but "
                                         f"model.seq_len={cfg.model.seq_len}; set model.seq_len={manifest.seq_len} "
                                         f"or prepare again with --seq-len {cfg.model.seq_len}")
    if tokenizer.name != cfg.data.tokenizer:
        raise ConfigError("data.source", f"{where!r} was prepared with the {tokenizer.name!r} tokenizer but "
                                         f"data.tokenizer={cfg.data.tokenizer!r}; set data.tokenizer="
                                         f"{tokenizer.name} or prepare again with --tokenizer {cfg.data.tokenizer}")
    if cfg.model.vocab < tokenizer.vocab_size:
        raise ConfigError("model.vocab", f"{cfg.model.vocab} is smaller than the {tokenizer.name} tokenizer's "
                                         f"vocabulary of {tokenizer.vocab_size} ids (data in {where!r}); "
                                         f"use model.vocab >= {tokenizer.vocab_size}")


def check_ids(cfg: Config, manifest: Manifest, split: str, examples: np.ndarray) -> None:
    """Every token id of ``examples`` (``split`` of ``manifest``) must be one of the model's
    ``[0, model.vocab)``: ConfigError on ``data.source`` naming the shard file, the record and
    the position of the first that is not (one vectorised pass)."""
    shards = manifest.shard_paths(split)

    def where(index) -> str:
        example, position = index[0], index[1] if len(index) > 1 else 0
        # prepare_dataset writes example e to shard e % S as its record e // S (records.read_split)
        return (f"{split} example {example}, position {position}: record {example // len(shards)} of "
                f"{shards[example % len(shards)]!r}")

    problem = check_token_ids(examples, cfg.model.vocab, "model.vocab", where)
    if problem is not None:
        raise ConfigError("data.source", f"{str(manifest.directory)!r}: {problem}")


def resolve_source(cfg: Config, *, progress: bool | None = None) -> Manifest:
    """The manifest of the prepared data for ``cfg.data.source``, preparing it if needed."""
    d = cfg.data
    source = d.source
    if source == "stdlib":
        root = corpus_lib.stdlib_root()
        files = corpus_lib.stdlib_files(root)
        kind, label = "stdlib", f"stdlib-{corpus_lib.python_tag()}"
    else:
        path = Path(os.path.expanduser(source))
        if path.is_dir():
            if not (path / MANIFEST).is_file():
                raise ConfigError("data.source", f"directory {source!r} has no {MANIFEST}: it is not a prepared "
                                                 f"dataset. Prepare text files with `phalanx data prepare --input "
                                                 f"'{source.rstrip('/')}/*.txt' --output DIR`, or give a glob")
            return _read_manifest_or_error(path)
        files = corpus_lib.glob_files(source)
        if not files:
            hint = "no such file or directory" if not any(c in source for c in "*?[") else "no file matches"
            raise ConfigError("data.source", f"{source!r}: {hint}; use stdlib, a prepared directory (with "
                                             f"{MANIFEST}) or a glob of text files such as 'corpus/*.txt'")
        root = corpus_lib.glob_root(source)
        kind, label = "glob", "glob"
    fingerprint = corpus_lib.files_fingerprint(files, root)
    key = {"format": records.FORMAT, "kind": kind, "source": source, "python": corpus_lib.python_tag(),
           "files": fingerprint, "tokenizer": d.tokenizer, "bpe_vocab": d.bpe_vocab if d.tokenizer == "bpe" else None,
           "seq_len": cfg.model.seq_len, "val_fraction": d.val_fraction, "max_bytes": d.max_bytes}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    cache_root = Path(os.path.expanduser(d.cache_dir)) / "data"
    target = cache_root / f"{label}-{d.tokenizer}-T{cfg.model.seq_len}-{digest}"
    if (target / MANIFEST).is_file():
        return _read_manifest_or_error(target)
    with _file_lock(cache_root / f".{target.name}.lock"):
        if (target / MANIFEST).is_file():  # another process prepared it while we waited
            return _read_manifest_or_error(target)
        corpus = corpus_lib.read_documents(files, root, d.max_bytes)
        source_info = {"kind": kind, "spec": source, "root": str(root), "files": len(files),
                       "files_fingerprint": fingerprint, "max_bytes": d.max_bytes, "cache_key": key}
        try:
            return records.prepare_dataset(corpus, target, tokenizer=d.tokenizer, seq_len=cfg.model.seq_len,
                                           val_fraction=d.val_fraction, bpe_vocab=d.bpe_vocab,
                                           source=source_info, progress=progress)
        except ValueError as err:  # too little text for the split / the window
            raise ConfigError("data.source", f"{source!r}: {err}") from None


def _read_manifest_or_error(path: Path) -> Manifest:
    try:
        return records.read_manifest(path)
    except (ValueError, FileNotFoundError, KeyError, json.JSONDecodeError) as err:
        raise ConfigError("data.source", f"{str(path)!r} is not a usable prepared dataset: {err}") from None


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock: several workers starting at once prepare the cache once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
