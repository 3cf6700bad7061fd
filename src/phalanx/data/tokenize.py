"""Tokenizers: text <-> token ids.

Two tokenizers share one interface (:class:`Tokenizer`):

* :class:`ByteTokenizer` (``"bytes"``): ids 0..255 are the UTF-8 bytes of the text.
  Needs no training and no file. Id 0 (the NUL byte, which never occurs in source
  text; the corpus readers drop it) separates documents.
* :class:`BpeTokenizer` (``"bpe"``): byte-level BPE trained locally with the
  ``tokenizers`` package. Id 0 is the special token ``<|sep|>`` that separates
  documents. Saved as ``tokenizer.json`` next to the prepared data and loaded back.

Example:
    >>> from phalanx.data.tokenize import ByteTokenizer
    >>> tok = ByteTokenizer()
    >>> tok.encode("hé")
    [104, 195, 169]
    >>> tok.decode([104, 195, 169])
    'hé'
"""

from __future__ import annotations

import abc
import json
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

SEPARATOR_ID = 0
BPE_SEPARATOR_TOKEN = "<|sep|>"
BPE_FILE = "tokenizer.json"
TOKENIZER_NAMES = ("bytes", "bpe")


class Tokenizer(abc.ABC):
    """Common interface of the tokenizers."""

    name: str
    separator_id: int = SEPARATOR_ID

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of distinct ids; every id is in ``[0, vocab_size)``."""

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no separator added)."""

    @abc.abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; invalid UTF-8 sequences become U+FFFD."""

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        """All ``texts`` as one int32 id stream, each followed by the separator id.

        Subclasses override this with a vectorised path; the result must equal
        ``concat(encode(t) + [separator_id] for t in texts)``.
        """
        parts = []
        for text in texts:
            parts.append(np.asarray(self.encode(text), dtype=np.int32))
            parts.append(np.array([self.separator_id], dtype=np.int32))
        return np.concatenate(parts) if parts else np.zeros([0], np.int32)

    @abc.abstractmethod
    def save(self, directory: str | Path) -> dict:
        """Write whatever is needed to load this tokenizer into ``directory``;
        returns the manifest entry for :func:`load_tokenizer`."""

    def manifest_entry(self) -> dict:
        return {"name": self.name, "vocab_size": self.vocab_size, "separator_id": self.separator_id}


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids (vocab 256).

    >>> ByteTokenizer().encode_documents(["ab", "c"]).tolist()
    [97, 98, 0, 99, 0]
    """

    name = "bytes"

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError(f"byte tokenizer ids must be in [0, 255], got min {arr.min()} max {arr.max()}")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        # One join and one frombuffer: ~GB/s, versus a Python loop over bytes.
        if not texts:
            return np.zeros([0], np.int32)
        blob = b"\x00".join(t.encode("utf-8") for t in texts) + b"\x00"
        return np.frombuffer(blob, dtype=np.uint8).astype(np.int32)

    def save(self, directory: str | Path) -> dict:
        return self.manifest_entry()  # nothing to write: the mapping is fixed


class BpeTokenizer(Tokenizer):
    """Byte-level BPE from the ``tokenizers`` package; id 0 is ``<|sep|>``.

    >>> tok = BpeTokenizer.train(["def f(x):\\n    return x\\n"] * 50, vocab_size=300)
    >>> tok.decode(tok.encode("def g(y):"))
    'def g(y):'
    """

    name = "bpe"

    def __init__(self, backend):  # backend: tokenizers.Tokenizer
        self._tok = backend
        # Text that happens to spell "<|sep|>" must stay text: only document boundaries get id 0.
        backend.encode_special_tokens = True
        sep = backend.token_to_id(BPE_SEPARATOR_TOKEN)
        if sep != SEPARATOR_ID:
            raise ValueError(f"BPE tokenizer must map {BPE_SEPARATOR_TOKEN!r} to id {SEPARATOR_ID}, got {sep}")

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "BpeTokenizer":
        """Train byte-level BPE on ``texts``; the result may hold fewer than
        ``vocab_size`` ids when the text has fewer merges to offer."""
        from tokenizers import Tokenizer as HfTokenizer, decoders, models, pre_tokenizers, trainers

        if vocab_size < 257:
            raise ValueError(f"BPE vocab_size must be >= 257 (256 bytes + separator), got {vocab_size}")
        backend = HfTokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[BPE_SEPARATOR_TOKEN],  # first special token gets id 0
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
            show_progress=False,
        )
        backend.train_from_iterator(texts, trainer=trainer)
        return cls(backend)

    @classmethod
    def load(cls, path: str | Path) -> "BpeTokenizer":
        from tokenizers import Tokenizer as HfTokenizer

        return cls(HfTokenizer.from_file(str(path)))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros([0], np.int32)
        # Parallel in Rust; the _fast variant skips character offsets (~1.5x faster).
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        encoded = encode(list(texts))
        parts = []
        sep = np.array([self.separator_id], np.int32)
        for enc in encoded:
            parts.append(np.asarray(enc.ids, dtype=np.int32))
            parts.append(sep)
        return np.concatenate(parts)

    def save(self, directory: str | Path) -> dict:
        self._tok.save(str(Path(directory) / BPE_FILE))
        return {**self.manifest_entry(), "file": BPE_FILE}


def load_tokenizer(directory: str | Path, entry: dict) -> Tokenizer:
    """The tokenizer described by a manifest ``entry`` of a prepared ``directory``.

    >>> load_tokenizer(".", {"name": "bytes"}).vocab_size
    256
    """
    name = entry.get("name")
    if name == "bytes":
        return ByteTokenizer()
    if name == "bpe":
        path = Path(directory) / entry.get("file", BPE_FILE)
        if not path.is_file():
            raise FileNotFoundError(f"BPE tokenizer file {str(path)!r} is missing")
        return BpeTokenizer.load(path)
    raise ValueError(f"unknown tokenizer {name!r}; known: {', '.join(TOKENIZER_NAMES)}")


def save_tokenizer(tokenizer: Tokenizer, directory: str | Path) -> None:
    """Save a run's tokenizer (for ``phalanx generate``) with the entry that
    :func:`load_run_tokenizer` reads it back by (``entry.json``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    entry = tokenizer.save(directory)
    (directory / "entry.json").write_text(json.dumps(entry))


def load_run_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer :func:`save_tokenizer` wrote to ``directory``."""
    directory = Path(directory)
    return load_tokenizer(directory, json.loads((directory / "entry.json").read_text()))
