"""The character-level language model recipe on Python's own documentation text
(``model=charlm data=pytext``): data split and windows, causality, and training."""

from __future__ import annotations

import math

import pytest
import torch

import lightning_acgc
from lightning_acgc.policies import available_policies
from recipes.config_schema import compose_config
from recipes.data import PyDocTextDataModule
from recipes.data.pytext import build_vocabulary, encode, pydoc_text
from recipes.models import CharLM
from recipes.train import train

QUIET = [
    "logger=false",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
]
# 2 x 32 model, windows of 32 characters: a step takes a few milliseconds
TINY = [
    "model=charlm",
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "data.seq_len=32",
    "data.batch_size=16",
]


def test_charlm_composes_with_the_pydoc_text_by_default() -> None:
    cfg = compose_config(["model=charlm"])
    assert cfg.data._target_ == "recipes.data.PyDocTextDataModule"
    assert cfg.model.num_classes == cfg.data.num_classes == 128
    assert cfg.model.max_seq_len == cfg.data.seq_len


def test_vocabulary_covers_the_text_and_maps_the_rest_to_other() -> None:
    text = pydoc_text()
    vocab = build_vocabulary(text, 128)
    assert len(set(text)) < 128 and len(vocab) == len(set(text))  # every character has an id
    ids = encode(text, vocab, 128)
    assert int(ids.max()) < 127  # the "other" id is unused at 128
    small = build_vocabulary(text, 10)
    assert len(small) == 9 and small[" "] == 0  # the space is the most frequent character
    assert int((encode(text, small, 10) == 9).sum()) > 0
    with pytest.raises(ValueError, match="num_classes=1"):
        build_vocabulary(text, 1)


def _joined(dataset: torch.utils.data.TensorDataset) -> torch.Tensor:
    x, y = dataset.tensors
    return torch.cat([x[:, 0:1], y], dim=1).reshape(-1)


def test_validation_is_the_end_of_the_text_and_the_same_for_every_seed() -> None:
    a = PyDocTextDataModule(num_classes=128, seq_len=50, num_windows=64, seed=0)
    b = PyDocTextDataModule(num_classes=128, seq_len=50, num_windows=64, seed=1)
    a.setup("fit")
    b.setup("fit")
    text = pydoc_text()
    ids = encode(text, build_vocabulary(text, 128), 128)
    n_val = round(len(ids) * 0.1)
    tail = ids[len(ids) - n_val :]
    x, y = a.val_set.tensors
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert torch.equal(x.reshape(-1), tail[: x.numel()])  # consecutive, non-overlapping
    assert torch.equal(y[-1], tail[x.numel() - 49 : x.numel() + 1])
    assert torch.equal(a.val_set.tensors[0], b.val_set.tensors[0])
    # training windows come from the training text only, at seeded positions
    assert not torch.equal(a.train_set.tensors[0], b.train_set.tensors[0])
    again = PyDocTextDataModule(num_classes=128, seq_len=50, num_windows=64, seed=0)
    again.setup("fit")
    assert torch.equal(a.train_set.tensors[0], again.train_set.tensors[0])
    train_text = "".join(map(chr, ids[: len(ids) - n_val].tolist()))  # ids as symbols
    for window in _joined(a.train_set).reshape(64, 51)[:8]:
        assert "".join(map(chr, window.tolist())) in train_text


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seq_len": 0}, "seq_len=0"),
        ({"num_windows": 0}, "num_windows=0"),
        ({"val_fraction": 1.0}, "val_fraction=1.0"),
        ({"num_classes": 1}, "num_classes=1"),
    ],
)
def test_bad_data_arguments_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PyDocTextDataModule(**kwargs)


def test_model_is_causal() -> None:
    module = CharLM(num_classes=20, max_seq_len=12, hidden_size=16, num_layers=2, num_heads=4)
    x = torch.randint(0, 20, (2, 12))
    changed = x.clone()
    changed[:, 7] = (x[:, 7] + 1) % 20
    a, b = module.net(x), module.net(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_model_saves_the_attention_matrix_for_backward() -> None:
    module = CharLM(num_classes=20, max_seq_len=12, hidden_size=16, num_layers=1, num_heads=4)
    shapes = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module.net(torch.randint(0, 20, (3, 12))).sum().backward()
    assert (3, 4, 12, 12) in shapes  # softmax output (eager attention, not fused)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"num_heads": 3}, "num_heads=3 must divide hidden_size=16"), ({"dropout": 1.0}, "dropout")],
)
def test_bad_model_arguments_are_refused(kwargs: dict, match: str) -> None:
    args = {"num_classes": 20, "max_seq_len": 8, "hidden_size": 16, "num_heads": 2}
    with pytest.raises(ValueError, match=match):
        CharLM(**{**args, **kwargs})


@pytest.mark.parametrize("compression", ["none", "fixed"])
def test_train_a_few_steps(compression: str) -> None:
    cfg = compose_config([*QUIET, *TINY, "trainer.fast_dev_run=3", f"compression={compression}"])
    if cfg.compression is not None:
        if "fixed" not in available_policies():
            pytest.skip("policy 'fixed' is not registered")
        cfg.compression.print_table = False
    metrics = train(cfg)
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["val/loss"])
    assert 0 <= metrics["val/acc"] <= 1
    if compression != "none":
        assert hasattr(lightning_acgc, "ActivationCompression")
        assert metrics["acgc/ratio"] > 2


@pytest.mark.slow
def test_loss_goes_down() -> None:
    # 2 epochs x 64 steps; uniform guessing is ln(128) = 4.85 nats/char, the character
    # frequencies alone about 3.2; a model that reads context gets well below
    cfg = compose_config(
        [*QUIET, *TINY, "data.num_windows=1024", "trainer.max_epochs=2", "model.lr=3e-3"]
    )
    metrics = train(cfg)
    assert metrics["val/loss"] < 2.9, metrics
    assert metrics["val/acc"] > 0.25, metrics
