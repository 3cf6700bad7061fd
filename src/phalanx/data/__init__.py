"""Data: tokenizers, the embedded stdlib corpus, TFRecord shards and the tf.data input.

Public API::

    make_datasets(cfg, worker_index=0, num_workers=1) -> Datasets     # pipeline.py
    Datasets.train / .val / .train_from(step) / .train_iterator(step)
    save_iterator(iterator, directory); restore_iterator(datasets, directory)
    prepare_dataset(corpus, output, tokenizer=..., seq_len=..., val_fraction=...)  # records.py
    ByteTokenizer, BpeTokenizer, load_tokenizer                        # tokenize.py

TensorFlow is imported lazily by the functions that need it.
"""

from phalanx.data.pipeline import Datasets, TrainIterator, make_datasets, restore_iterator, save_iterator
from phalanx.data.records import Manifest, prepare_dataset, read_manifest
from phalanx.data.tokenize import BpeTokenizer, ByteTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "BpeTokenizer", "ByteTokenizer", "Datasets", "Manifest", "Tokenizer", "TrainIterator", "load_tokenizer",
    "make_datasets", "prepare_dataset", "read_manifest", "restore_iterator", "save_iterator",
]
