"""tf.data input: determinism, worker sharding, epochs, iterator resume, sources, errors."""

import json

import numpy as np
import pytest

from phalanx.config import ConfigError, load_config
from phalanx.data import pipeline, records
from phalanx.data.pipeline import make_datasets, restore_iterator, save_iterator

SEQ = 16


def write_corpus(directory, n_files=24, lines=10, seed=0):
    """Random text: every window of the token stream is distinct, so rows identify examples."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz "))
    directory.mkdir(parents=True, exist_ok=True)
    for f in range(n_files):
        text = "".join("".join(rng.choice(letters, 40)) + "\n" for _ in range(lines))
        (directory / f"f{f:02d}.txt").write_text(text)
    return str(directory / "*.txt")


def config(tmp, source, *extra):
    return load_config(None, [f"data.source={source}", f"data.cache_dir={tmp / 'cache'}", f"model.seq_len={SEQ}",
                              "train.global_batch=8", "data.val_fraction=0.1", *extra])


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data")
    return tmp, write_corpus(tmp / "corpus")


@pytest.fixture(scope="module")
def one(env):
    tmp, glob = env
    return make_datasets(config(tmp, glob), progress=False)


def take(ds, n):
    return [b.numpy() for b in ds.take(n)]


def row_index(datasets):
    """bytes of an example row -> its index among the training examples."""
    arr = datasets._examples.numpy().astype(np.int32)
    index = {row.tobytes(): i for i, row in enumerate(arr)}
    assert len(index) == len(arr), "fixture text must make every example distinct"
    return index


def test_shapes_dtypes_and_vocab(one):
    batch = next(iter(one.train))
    assert batch.dtype.name == "int32" and batch.shape.as_list() == [8, SEQ + 1]
    assert one.vocab_size == 256 and one.tokenizer.name == "bytes" and one.batch_size == 8
    assert one.num_train_examples > 40 and one.num_val_examples > 0
    val = take(one.val, 1000)
    assert len(val) == one.val_batches and all(b.shape == (8, SEQ + 1) for b in val)


def test_same_seed_same_batches_other_seed_differs(env, one):
    tmp, glob = env
    again = make_datasets(config(tmp, glob), progress=False)
    for a, b in zip(take(one.train, 6), take(again.train, 6)):
        np.testing.assert_array_equal(a, b)
    other = make_datasets(config(tmp, glob, "train.seed=1"), progress=False)
    assert not np.array_equal(np.stack(take(one.train, 3)), np.stack(take(other.train, 3)))


@pytest.mark.parametrize("workers", [2, 4])
def test_workers_slices_concatenate_to_the_global_batch(env, one, workers):
    tmp, glob = env
    cfg = config(tmp, glob)
    parts = [take(make_datasets(cfg, w, workers, progress=False).train, 12) for w in range(workers)]
    for k, whole in enumerate(take(one.train, 12)):
        assert all(p[k].shape == (8 // workers, SEQ + 1) for p in parts)
        np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), whole)
    vals = [take(make_datasets(cfg, w, workers, progress=False).val, 100) for w in range(workers)]
    for k, whole in enumerate(take(one.val, 100)):
        np.testing.assert_array_equal(np.concatenate([v[k] for v in vals]), whole)


def test_each_epoch_sees_every_example_once_across_workers(env, one):
    tmp, glob = env
    index = row_index(one)
    n, g = one.num_train_examples, one.global_batch
    steps = -(-2 * n // g)  # two epochs and a bit
    workers = [make_datasets(config(tmp, glob), w, 2, progress=False) for w in range(2)]
    streams = [take(d.train, steps) for d in workers]
    seen = []
    for k in range(steps):
        for w in range(2):
            seen.extend(index[row.tobytes()] for row in streams[w][k])
    for epoch in range(2):
        assert sorted(seen[epoch * n:(epoch + 1) * n]) == list(range(n))
    assert seen[:n] != seen[n:2 * n]  # each epoch is a fresh permutation
    assert seen == list(one.global_batch_at(0)) + [i for k in range(1, steps) for i in one.global_batch_at(k)]


def test_val_never_overlaps_train(one):
    index = row_index(one)
    val_rows = [row for b in take(one.val, 1000) for row in b]
    assert val_rows and not any(row.tobytes() in index for row in val_rows)


def test_val_is_finite_and_deterministic(env, one):
    a, b = take(one.val, 1000), take(one.val, 1000)
    assert len(a) == one.val_batches == max(1, one.num_val_examples // 8)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_small_val_split_is_cycled_into_one_batch(env):
    tmp, glob = env
    ds = make_datasets(config(tmp, glob, "train.global_batch=64"), progress=False)
    assert ds.num_val_examples < 64
    batches = take(ds.val, 10)
    assert len(batches) == 1 and batches[0].shape == (64, SEQ + 1)
    distinct = {row.tobytes() for row in batches[0]}
    assert len(distinct) == ds.num_val_examples


@pytest.mark.parametrize("workers", [1, 2])
def test_iterator_save_restore_resumes_exactly(env, tmp_path, workers):
    tmp, glob = env
    cfg = config(tmp, glob)
    for w in range(workers):
        ds = make_datasets(cfg, w, workers, progress=False)
        it = ds.train_iterator()
        for _ in range(7):
            next(it)
        path = save_iterator(it, tmp_path / f"ckpt{w}")
        assert path.stat().st_size < 1024 and it.step == 7
        expected = [next(it).numpy() for _ in range(30)]  # crosses an epoch boundary
        resumed = restore_iterator(make_datasets(cfg, w, workers, progress=False), tmp_path / f"ckpt{w}")
        assert resumed.step == 7
        for e in expected:
            np.testing.assert_array_equal(next(resumed).numpy(), e)
        uninterrupted = take(ds.train, 37)[7:]
        for a, b in zip(uninterrupted, expected):
            np.testing.assert_array_equal(a, b)


def test_tf_train_checkpoint_of_the_iterator_is_small_and_exact(tmp_path):
    # The trainer may also checkpoint the tf.data iterator itself: its state is the step
    # counter plus the prefetch buffer, never the dataset (a cache()+shuffle() pipeline
    # would store all examples and the shuffle buffer).
    import tensorflow as tf

    one = make_datasets(config(tmp_path, "stdlib", "data.max_bytes=300000"), progress=False)
    it = iter(one.train)
    for _ in range(5):
        next(it)
    path = tf.train.Checkpoint(iterator=it).write(str(tmp_path / "ckpt" / "it"))
    size = sum(f.stat().st_size for f in (tmp_path / "ckpt").iterdir())
    assert size < one._examples.numpy().nbytes / 20
    expected = [next(it).numpy() for _ in range(4)]
    fresh = iter(one.train)
    tf.train.Checkpoint(iterator=fresh).read(path).assert_consumed()
    for e in expected:
        np.testing.assert_array_equal(next(fresh).numpy(), e)


def test_restore_refuses_other_seed_batch_or_data(env, tmp_path, one):
    tmp, glob = env
    it = one.train_iterator(3)
    save_iterator(it, tmp_path)
    with pytest.raises(ConfigError, match="seed") as err:
        restore_iterator(make_datasets(config(tmp, glob, "train.seed=5"), progress=False), tmp_path)
    assert err.value.key == "train.seed"
    with pytest.raises(ConfigError) as err:
        restore_iterator(make_datasets(config(tmp, glob, "train.global_batch=16"), progress=False), tmp_path)
    assert err.value.key == "train.global_batch"
    state = json.loads((tmp_path / pipeline.ITERATOR_FILE).read_text())
    state["dataset"] = "0" * 64
    (tmp_path / pipeline.ITERATOR_FILE).write_text(json.dumps(state))
    with pytest.raises(ConfigError) as err:
        restore_iterator(one, tmp_path)
    assert err.value.key == "data.source"
    with pytest.raises(FileNotFoundError):
        restore_iterator(one, tmp_path / "nothing")


def test_glob_source_is_cached_and_refreshed_when_files_change(tmp_path, monkeypatch):
    glob = write_corpus(tmp_path / "corpus", n_files=12)
    first = make_datasets(config(tmp_path, glob), progress=False)
    calls = []
    real = records.prepare_dataset
    monkeypatch.setattr(records, "prepare_dataset", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = make_datasets(config(tmp_path, glob), progress=False)
    assert calls == [] and again.directory == first.directory
    (tmp_path / "corpus" / "f00.txt").write_text("changed text\n" * 50)
    changed = make_datasets(config(tmp_path, glob), progress=False)
    assert calls == [1] and changed.directory != first.directory
    other_len = make_datasets(config(tmp_path, glob, "model.seq_len=8"), progress=False)
    assert calls == [1, 1] and other_len.manifest.seq_len == 8


def test_concurrent_starts_prepare_the_cache_once(tmp_path, monkeypatch):
    # Several workers of one job start together; the file lock makes one prepare and the rest wait.
    import threading

    glob = write_corpus(tmp_path / "corpus", n_files=8)
    calls = []
    real = records.prepare_dataset

    def slow_prepare(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(records, "prepare_dataset", slow_prepare)
    found = []
    threads = [threading.Thread(target=lambda: found.append(pipeline.resolve_source(config(tmp_path, glob),
                                                                                     progress=False)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(found) == 3 and len({m.directory for m in found}) == 1


def test_prepared_directory_source(env, one):
    tmp, _ = env
    ds = make_datasets(config(tmp, str(one.directory)), progress=False)
    assert ds.directory == one.directory
    np.testing.assert_array_equal(take(ds.train, 1)[0], take(one.train, 1)[0])


def test_stdlib_source_with_max_bytes(tmp_path):
    cfg = config(tmp_path, "stdlib", "data.max_bytes=60000")
    ds = make_datasets(cfg, progress=False)
    m = ds.manifest
    assert m.source["kind"] == "stdlib" and m.source["truncated"] and m.source["bytes"] == 60000
    assert ds.directory.parent == tmp_path / "cache" / "data" and ds.directory.name.startswith("stdlib-py3")
    text = ds.tokenizer.decode(take(ds.train, 1)[0][0])
    assert len(text) > 0
    assert make_datasets(cfg, progress=False).directory == ds.directory


def test_bpe_source(env):
    tmp, glob = env
    ds = make_datasets(config(tmp, glob, "data.tokenizer=bpe", "data.bpe_vocab=300", "model.vocab=300"),
                       progress=False)
    assert ds.tokenizer.name == "bpe" and ds.vocab_size <= 300
    assert int(take(ds.train, 1)[0].max()) < ds.vocab_size


# --- errors ---------------------------------------------------------------------------------------------


def error_of(cfg, **kw):
    with pytest.raises(ConfigError) as err:
        make_datasets(cfg, progress=False, **kw)
    return err.value


def test_error_missing_path(tmp_path):
    e = error_of(config(tmp_path, str(tmp_path / "nope")))
    assert e.key == "data.source" and "no such file or directory" in str(e)


def test_error_glob_matches_nothing(tmp_path):
    e = error_of(config(tmp_path, str(tmp_path / "*.txt")))
    assert e.key == "data.source" and "no file matches" in str(e) and "stdlib" in str(e)


def test_error_directory_without_manifest(tmp_path):
    (tmp_path / "raw").mkdir()
    e = error_of(config(tmp_path, str(tmp_path / "raw")))
    assert e.key == "data.source" and "no manifest.json" in str(e) and "phalanx data prepare" in str(e)


def test_error_seq_len_mismatch(env, one):
    tmp, _ = env
    e = error_of(config(tmp, str(one.directory), "model.seq_len=32"))
    assert e.key == "data.source" and "seq_len 16" in str(e) and "model.seq_len=32" in str(e)


def test_error_tokenizer_mismatch(env, one):
    tmp, _ = env
    e = error_of(config(tmp, str(one.directory), "data.tokenizer=bpe", "model.vocab=4096"))
    assert e.key == "data.source" and "'bytes' tokenizer" in str(e) and "data.tokenizer='bpe'" in str(e)


def test_error_model_vocab_smaller_than_tokenizer(env, tmp_path):
    tmp, glob = env
    from phalanx.data.corpus import glob_files, glob_root, read_documents

    corpus = read_documents(glob_files(glob), glob_root(glob))
    records.prepare_dataset(corpus, tmp_path / "bpe", tokenizer="bpe", bpe_vocab=320, seq_len=SEQ,
                            val_fraction=0.1, progress=False)
    e = error_of(config(tmp, str(tmp_path / "bpe"), "data.tokenizer=bpe", "data.bpe_vocab=257", "model.vocab=257"))
    assert e.key == "model.vocab" and "smaller than the bpe tokenizer's vocabulary" in str(e)


def test_error_broken_manifest(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "manifest.json").write_text('{"format": "other/9"}')
    e = error_of(config(tmp_path, str(tmp_path / "ds")))
    assert e.key == "data.source" and "not a usable prepared dataset" in str(e)


def test_error_too_little_text(tmp_path):
    (tmp_path / "c").mkdir()
    for i in range(3):
        (tmp_path / "c" / f"{i}.txt").write_text("tiny\n")
    e = error_of(config(tmp_path, str(tmp_path / "c" / "*.txt")))
    assert e.key == "data.source" and "fewer than seq_len + 1" in str(e)


def test_error_workers_must_divide_global_batch(env):
    tmp, glob = env
    e = error_of(config(tmp, glob), worker_index=0, num_workers=3)
    assert e.key == "train.global_batch" and "not divisible by the 3 workers" in str(e)
    with pytest.raises(ValueError, match="worker_index"):
        make_datasets(config(tmp, glob), worker_index=2, num_workers=2, progress=False)
