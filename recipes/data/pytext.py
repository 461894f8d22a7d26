"""Real English text that ships with Python, for a character-level language model.

The text is ``pydoc_data.topics.topics``: the documentation topics of the standard
library (about 465,000 characters of English prose and code), installed with every
CPython, so the recipe runs offline with nothing downloaded. Batches are
``(inputs, targets)`` of shape ``(batch, seq_len)``: ``targets`` is ``inputs`` shifted
by one character.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils.data import TensorDataset

from recipes.data.base import SplitDataModule

__all__ = ["PyDocTextDataModule", "build_vocabulary", "encode", "pydoc_text"]


def pydoc_text() -> str:
    """The documentation topics of ``pydoc_data`` concatenated in key order (stable for
    a given Python version).

    Example:
        >>> text = pydoc_text()
        >>> len(text) > 100_000 and "assert" in text
        True
    """
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics))


def build_vocabulary(text: str, num_classes: int) -> dict[str, int]:
    """Ids of the ``num_classes - 1`` most frequent characters of ``text`` (ties by
    code point), most frequent first; every other character maps to the last id,
    ``num_classes - 1``.

    Raises:
        ValueError: ``num_classes`` below 2.

    Example:
        >>> build_vocabulary("abbccc", 3)
        {'c': 0, 'b': 1}
    """
    if num_classes < 2:
        raise ValueError(f"num_classes={num_classes!r} must be >= 2 (characters + 'other')")
    ranked = sorted(Counter(text).items(), key=lambda kv: (-kv[1], kv[0]))
    return {ch: i for i, (ch, _) in enumerate(ranked[: num_classes - 1])}


def encode(text: str, vocabulary: dict[str, int], num_classes: int) -> torch.Tensor:
    """``text`` as a 1-D ``int64`` tensor of character ids (unknown: ``num_classes - 1``).

    Example:
        >>> encode("abcz", {"c": 0, "b": 1}, 3).tolist()
        [2, 1, 0, 2]
    """
    other = num_classes - 1
    return torch.tensor([vocabulary.get(ch, other) for ch in text], dtype=torch.long)


def _windows(ids: torch.Tensor, starts: torch.Tensor, seq_len: int) -> TensorDataset:
    idx = starts[:, None] + torch.arange(seq_len + 1)
    chunks = ids[idx]
    return TensorDataset(chunks[:, :-1].contiguous(), chunks[:, 1:].contiguous())


class PyDocTextDataModule(SplitDataModule):
    """Character-level language modelling on Python's documentation topics.

    The concatenated text is split by position: the last ``val_fraction`` of it is the
    validation text, read as consecutive non-overlapping windows (the same for every
    seed), the rest is the training text, from which ``num_windows`` windows start at
    positions drawn from ``seed``. One epoch reads every training window once, in an
    order drawn from ``seed``.

    Args:
        num_classes: vocabulary size: the ``num_classes - 1`` most frequent characters
            of the whole text plus one id for every other character (the text holds
            about 100 distinct characters, so 128 covers all of them).
        seq_len: characters per window (the model's context length).
        num_windows: training windows per epoch.
        val_fraction: share of the text, at its end, held out for validation.
        batch_size: training batch size.
        num_workers: data loader worker processes.
        seed: seed of the training windows' start positions and of their order.

    Raises:
        ValueError: a bad ``num_classes``, ``seq_len``, ``num_windows`` or ``val_fraction``.

    Example:
        >>> dm = PyDocTextDataModule(seq_len=16, num_windows=64, batch_size=8)
        >>> dm.setup("fit")
        >>> x, y = next(iter(dm.train_dataloader()))
        >>> tuple(x.shape), bool((x[:, 1:] == y[:, :-1]).all())
        ((8, 16), True)
    """

    def __init__(
        self,
        num_classes: int = 128,
        seq_len: int = 128,
        num_windows: int = 8192,
        val_fraction: float = 0.1,
        batch_size: int = 32,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers, seed)
        if num_classes < 2:
            raise ValueError(f"num_classes={num_classes!r} must be >= 2")
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len!r} must be >= 1")
        if num_windows < 1:
            raise ValueError(f"num_windows={num_windows!r} must be >= 1")
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction={val_fraction!r} must be in (0, 1)")
        self.num_classes = num_classes
        self.seq_len = seq_len
        self.num_windows = num_windows
        self.val_fraction = val_fraction

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        text = pydoc_text()
        ids = encode(text, build_vocabulary(text, self.num_classes), self.num_classes)
        n_val = round(len(ids) * self.val_fraction)
        train_ids, val_ids = ids[: len(ids) - n_val], ids[len(ids) - n_val :]
        span = self.seq_len + 1
        if len(val_ids) < span or len(train_ids) < span:
            raise ValueError(
                f"seq_len={self.seq_len} is longer than the training or validation text "
                f"({len(train_ids)} and {len(val_ids)} characters)"
            )
        g = torch.Generator().manual_seed(self.seed)
        starts = torch.randint(0, len(train_ids) - span + 1, (self.num_windows,), generator=g)
        self.train_set = _windows(train_ids, starts, self.seq_len)
        val_starts = torch.arange(0, len(val_ids) - span + 1, self.seq_len)
        self.val_set = _windows(val_ids, val_starts, self.seq_len)
        self.source = f"pydoc_data topics ({len(text)} characters, {self.num_classes} ids)"
