"""Text data: a generated task that needs attention (offline default) and GLUE.

Batches are ``(input_ids, attention_mask, labels)`` of fixed length ``seq_len``.
"""

from __future__ import annotations

import importlib.util

import torch
from torch.utils.data import TensorDataset

from recipes.data.availability import (
    data_root,
    fall_back_or_raise,
    hf_cache_only,
    network_problem,
)
from recipes.data.base import SplitDataModule, split_indices

__all__ = ["GLUE_TASKS", "GlueDataModule", "SyntheticTextDataModule", "make_marker_order_task"]

PAD, CLS, SEP = 0, 1, 2  # token ids of the generated task; markers follow, then fillers


def make_marker_order_task(
    num_samples: int, seq_len: int, vocab_size: int, num_classes: int, seed: int
) -> TensorDataset:
    """Sequences holding each of ``num_classes`` marker tokens once, among random fillers;
    the label is the marker that comes first.

    Every sequence contains the same markers, so counting tokens (a bag of words) stays
    at chance: the model has to compare the markers' positions, i.e. attend. Lengths
    vary between ``seq_len // 2`` and ``seq_len`` (padding masked); token ids: 0 pad,
    1 ``[CLS]`` (first), 2 ``[SEP]`` (last), ``3 .. 3 + num_classes - 1`` the markers,
    the rest fillers.

    Args:
        num_samples: number of sequences.
        seq_len: padded length (``[CLS]`` and ``[SEP]`` included).
        vocab_size: token ids are below this.
        num_classes: number of markers (= classes; 2 is "does A come before B").
        seed: seed of the generator (the task is a pure function of its arguments).

    Returns:
        ``TensorDataset(input_ids, attention_mask, labels)``.

    Raises:
        ValueError: too few positions or tokens for the markers.

    Example:
        >>> ids, mask, y = make_marker_order_task(4, 12, 20, 2, seed=0).tensors
        >>> tuple(ids.shape), bool(((ids == 3).sum(1) == 1).all()), y.tolist()
        ((4, 12), True, [1, 0, 1, 0])
    """
    first_filler = 3 + num_classes
    min_len = max(seq_len // 2, num_classes + 2)
    if num_classes < 2 or seq_len < num_classes + 2:
        raise ValueError(
            f"seq_len={seq_len} must leave room for [CLS], [SEP] and num_classes={num_classes} "
            f"markers (num_classes >= 2)"
        )
    if vocab_size <= first_filler:
        raise ValueError(
            f"vocab_size={vocab_size} must exceed {first_filler} (3 special tokens and "
            f"{num_classes} markers) to leave filler tokens"
        )
    g = torch.Generator().manual_seed(seed)
    n = num_samples
    lengths = torch.randint(min_len, seq_len + 1, (n,), generator=g)
    ids = torch.randint(first_filler, vocab_size, (n, seq_len), generator=g)
    pos = torch.arange(seq_len).expand(n, -1)
    # num_classes distinct content positions per sequence: the smallest random keys
    keys = torch.rand(n, seq_len, generator=g)
    keys[(pos == 0) | (pos >= (lengths - 1)[:, None])] = 2.0  # [CLS], [SEP] and padding
    marker_pos = keys.topk(num_classes, dim=1, largest=False).indices
    marker = torch.rand(n, num_classes, generator=g).argsort(dim=1)  # which marker where
    ids.scatter_(1, marker_pos, 3 + marker)
    labels = marker.gather(1, marker_pos.argmin(dim=1, keepdim=True)).squeeze(1)
    ids[:, 0] = CLS
    ids.scatter_(1, (lengths - 1)[:, None], SEP)
    attention_mask = pos < lengths[:, None]
    ids[~attention_mask] = PAD
    return TensorDataset(ids, attention_mask.long(), labels)


class SyntheticTextDataModule(SplitDataModule):
    """The generated marker-order task of :func:`make_marker_order_task`, offline.

    Args:
        num_samples: sequences generated (training and validation together).
        val_fraction: share held out for validation.
        seq_len: padded sequence length.
        vocab_size: size of the token vocabulary.
        num_classes: number of markers, i.e. classes.
        batch_size: training batch size.
        num_workers: data loader worker processes.
        seed: seed of the generator, the split and the shuffling.

    Example:
        >>> dm = SyntheticTextDataModule(num_samples=100, seq_len=16, batch_size=8)
        >>> dm.setup("fit")
        >>> [tuple(t.shape) for t in next(iter(dm.train_dataloader()))]
        [(8, 16), (8, 16), (8,)]
    """

    def __init__(
        self,
        num_samples: int = 6000,
        val_fraction: float = 0.2,
        seq_len: int = 32,
        vocab_size: int = 128,
        num_classes: int = 2,
        batch_size: int = 64,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers, seed)
        split_indices(2, val_fraction, seed)  # checks the fraction now
        self.num_samples = num_samples
        self.val_fraction = val_fraction
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.num_classes = num_classes
        make_marker_order_task(1, seq_len, vocab_size, num_classes, seed)  # checks sizes now

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        self.train_set, self.val_set = synthetic_splits(
            self.num_samples,
            self.seq_len,
            self.vocab_size,
            self.num_classes,
            self.val_fraction,
            self.seed,
        )
        self.source = f"synthetic marker-order task ({self.num_classes} classes)"


def synthetic_splits(
    num_samples: int,
    seq_len: int,
    vocab_size: int,
    num_classes: int,
    val_fraction: float,
    seed: int,
) -> tuple[TensorDataset, TensorDataset]:
    """Training and validation sets of :func:`make_marker_order_task`."""
    data = make_marker_order_task(num_samples, seq_len, vocab_size, num_classes, seed)
    train_idx, val_idx = split_indices(num_samples, val_fraction, seed)
    return TensorDataset(*data[train_idx]), TensorDataset(*data[val_idx])


# task -> (text fields, number of labels, validation split)
GLUE_TASKS: dict[str, tuple[tuple[str, ...], int, str]] = {
    "cola": (("sentence",), 2, "validation"),
    "sst2": (("sentence",), 2, "validation"),
    "mrpc": (("sentence1", "sentence2"), 2, "validation"),
    "qqp": (("question1", "question2"), 2, "validation"),
    "mnli": (("premise", "hypothesis"), 3, "validation_matched"),
    "qnli": (("question", "sentence"), 2, "validation"),
    "rte": (("sentence1", "sentence2"), 2, "validation"),
    "wnli": (("sentence1", "sentence2"), 2, "validation"),
}


class GlueDataModule(SplitDataModule):
    """A GLUE classification task from the Hugging Face hub (``datasets``), tokenized.

    ``datasets`` is optional and never needed offline. Where it is missing, the hub
    does not answer within ``timeout_s`` or ``ACGC_OFFLINE=1`` is set, or loading fails
    (with ``HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1`` it loads from the local cache),
    this falls back to the offline default, the generated marker-order task with the
    same ``seq_len``, ``vocab_size`` and ``num_classes``,
    with a warning, or raises if ``fallback`` is false.

    Args:
        task: one of :data:`GLUE_TASKS` (STS-B, a regression, is not offered).
        tokenizer: Hugging Face tokenizer name or local directory.
        seq_len: tokens per example (truncated and padded to it).
        vocab_size: must be at least the tokenizer's vocabulary (the model reads it).
        num_classes: must be the task's number of labels (the model reads it).
        max_train_samples: use only the first this many training examples (``None``: all).
        root: cache directory of data sets and tokenizers (``~`` is expanded).
        fallback: train on the offline default when GLUE is not available.
        timeout_s: seconds allowed for the network probe.
        batch_size: training batch size.
        num_workers: data loader worker processes.
        seed: seed of the shuffling (and of the fallback's generator).

    Raises:
        ValueError: an unknown task, or a class count the task does not have.
        DataUnavailableError: GLUE is not available and ``fallback`` is false.
    """

    def __init__(
        self,
        task: str = "sst2",
        tokenizer: str = "bert-base-uncased",
        seq_len: int = 128,
        vocab_size: int = 30522,
        num_classes: int = 2,
        max_train_samples: int | None = None,
        root: str = "~/.cache/lightning_acgc/data",
        fallback: bool = True,
        timeout_s: float = 3.0,
        batch_size: int = 32,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers, seed)
        if task not in GLUE_TASKS:
            raise ValueError(f"task={task!r} is unknown; allowed values: {sorted(GLUE_TASKS)}")
        if num_classes != GLUE_TASKS[task][1]:
            raise ValueError(
                f"num_classes={num_classes!r}: GLUE {task} has {GLUE_TASKS[task][1]} labels"
            )
        self.task = task
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.num_classes = num_classes
        self.max_train_samples = max_train_samples
        self.root = root
        self.fallback = fallback
        self.timeout_s = timeout_s

    def _unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("datasets") is None:
            return "the `datasets` package is not installed (pip install datasets)"
        if hf_cache_only():
            return None  # load from the local caches
        problem = network_problem("huggingface.co", timeout_s=self.timeout_s)
        if problem:
            return f"{problem} (for a local cache, set HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1)"
        return None

    def _load(self) -> tuple[TensorDataset, TensorDataset]:
        import datasets
        from transformers import AutoTokenizer

        cache = str(data_root(self.root))
        fields, _, val_split = GLUE_TASKS[self.task]
        raw = datasets.load_dataset("nyu-mll/glue", self.task, cache_dir=cache)
        tok = AutoTokenizer.from_pretrained(
            self.tokenizer, cache_dir=cache, local_files_only=hf_cache_only()
        )
        if len(tok) > self.vocab_size:
            raise ValueError(
                f"vocab_size={self.vocab_size} is below the tokenizer's {len(tok)} tokens; "
                f"set data.vocab_size={len(tok)}"
            )

        def encode(split: str, limit: int | None) -> TensorDataset:
            rows = raw[split] if limit is None else raw[split].select(range(limit))
            enc = tok(
                *(rows[f] for f in fields),
                padding="max_length",
                truncation=True,
                max_length=self.seq_len,
                return_tensors="pt",
            )
            labels = torch.as_tensor(rows["label"])
            return TensorDataset(enc["input_ids"], enc["attention_mask"], labels)

        return encode("train", self.max_train_samples), encode(val_split, None)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        reason = self._unavailable_reason()
        if reason is None:
            try:
                self.train_set, self.val_set = self._load()
                self.source = f"GLUE {self.task} (tokenizer {self.tokenizer})"
                return
            except (OSError, ConnectionError, ValueError) as err:
                reason = f"loading failed: {type(err).__name__}: {err}"
        fall_back_or_raise(f"GLUE {self.task}", reason, "data=text", self.fallback)
        self.train_set, self.val_set = synthetic_splits(
            6000, self.seq_len, self.vocab_size, self.num_classes, 0.2, self.seed
        )
        self.source = f"synthetic marker-order task [fallback for GLUE {self.task}]"
