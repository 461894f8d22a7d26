"""The Lightning adapter hands a noise-relative ``acgc`` the gradients of each
calibration step's two half-batches: the budget follows the batch's sampling noise as in
plain PyTorch, once per step under accumulation, and a batch without a batch dimension
falls back to a fixed bound with one warning."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_acgc import ActivationCompression
from lightning_acgc.lightning.halves import split_batch
from tests._lightning_models import fit


@pytest.mark.parametrize(
    ("batch", "first_len"),
    [
        ((torch.zeros(6, 2), torch.zeros(6)), 3),
        ([torch.zeros(7, 2), torch.zeros(7)], 3),
        ({"x": torch.zeros(4, 3), "meta": {"y": torch.zeros(4)}, "tag": "a"}, 2),
        (torch.zeros(5, 1), 2),
    ],
)
def test_split_batch_cuts_every_tensor(batch: object, first_len: int) -> None:
    halves = split_batch(batch)
    assert halves is not None
    whole: list[int] = []
    apply_to_collection(batch, torch.Tensor, lambda t: whole.append(t.shape[0]))
    for half, expected in zip(halves, (first_len, whole[0] - first_len), strict=True):
        lengths: list[int] = []
        apply_to_collection(half, torch.Tensor, lambda t, out=lengths: out.append(t.shape[0]))
        assert lengths == [expected] * len(whole)
        assert type(half) is type(batch)
    if isinstance(batch, dict):
        assert halves[1]["tag"] == "a"


@pytest.mark.parametrize(
    "batch",
    [
        (torch.zeros(1, 3), torch.zeros(1)),  # one sample
        (torch.zeros(4, 3), torch.zeros(5)),  # no common batch dimension
        ("text", 3),  # no tensor
        (torch.tensor(1.0),),  # 0-d
        object(),  # not a collection (a graph)
    ],
)
def test_split_batch_refuses_what_has_no_batch_dimension(batch: object) -> None:
    assert split_batch(batch) is None


def _stack_xy(rows: list) -> dict:
    return {"x": torch.stack([r[0] for r in rows]), "y": torch.stack([r[1] for r in rows])}


class Regression(LightningModule):
    """y = x·w* + ε at w = w* + u (‖u‖ = 1): the gradient's sampling noise is known in
    closed form (as in tests/test_acgc_quant.py's plain-PyTorch case)."""

    def __init__(self, batch: int, d: int = 64, steps: int = 6, dict_batch: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w_star = torch.randn(d, generator=g)
        u = torch.randn(d, generator=g)
        self.net = nn.Linear(d, 1, bias=False)
        with torch.no_grad():
            self.net.weight.copy_(self.w_star + u / u.norm())
        x = torch.randn(batch * steps, d, generator=g)
        y = x @ self.w_star + torch.randn(batch * steps, generator=g)
        self.data = TensorDataset(x, y)
        self.batch, self.d, self.dict_batch = batch, d, dict_batch
        self.calls = 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        x, y = (batch["x"], batch["y"]) if self.dict_batch else batch
        return (self.net(x).squeeze(1) - y).square().mean()

    def train_dataloader(self):
        if not self.dict_batch:
            return DataLoader(self.data, batch_size=self.batch)
        return DataLoader(
            self.data,
            batch_size=self.batch,
            collate_fn=_stack_xy,
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # w stays where u puts it

    def expected_target(self, rho: float) -> float:
        trace = 4 * (2 * self.d + 1) / self.batch  # σ = 1, ‖u‖ = 1
        return rho * math.sqrt(trace / (4 + trace))


def _callback(**options: object) -> ActivationCompression:
    return ActivationCompression(
        policy="acgc", calibrate_every=1, min_numel=0, print_table=False, **options
    )


@pytest.mark.parametrize("dict_batch", [False, True])
def test_the_budget_follows_the_sampling_noise(dict_batch: bool) -> None:
    model = Regression(batch=512, dict_batch=dict_batch)
    cb = _callback(noise_ratio=0.5)
    fit(model, [cb], max_steps=6)
    metrics = cb.policy.metrics()
    assert metrics["noise_error"] > 0
    assert metrics["error_target"] == pytest.approx(model.expected_target(0.5), rel=0.25)
    assert metrics["grad_error"] <= metrics["error_target"]


def test_a_larger_batch_gets_a_tighter_bound() -> None:
    targets = []
    for batch in (128, 1024):
        cb = _callback(noise_ratio=0.5)
        fit(Regression(batch=batch), [cb], max_steps=4)
        targets.append(cb.policy.metrics()["error_target"])
    assert targets[1] < 0.6 * targets[0]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_halves_once_per_calibration_step(accumulate: int) -> None:
    steps = 4
    with_noise, without = (Regression(batch=64, steps=steps * accumulate) for _ in range(2))
    fit(
        with_noise,
        [_callback(noise_ratio=0.5)],
        max_steps=steps,
        accumulate_grad_batches=accumulate,
    )
    fit(
        without,
        [_callback(gradient_error=0.1)],
        max_steps=steps,
        accumulate_grad_batches=accumulate,
    )
    # the same steps calibrate (every step here); the halves add 2 calls a step
    assert with_noise.calls == without.calls + 2 * steps


def test_accumulated_steps_measure_the_step_noise() -> None:
    """k batches of B accumulated: the noise of one step of k·B, not of one batch."""
    one = _callback(noise_ratio=0.5)
    fit(Regression(batch=512), [one], max_steps=3)
    accumulated = _callback(noise_ratio=0.5)
    fit(Regression(batch=128, steps=12), [accumulated], max_steps=3, accumulate_grad_batches=4)
    a, b = (cb.policy.metrics()["error_target"] for cb in (one, accumulated))
    assert b == pytest.approx(a, rel=0.3)


class _Graph(Dataset):
    """One 'graph' per batch: a custom object the splitter must not cut."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(10, 8, generator=g), "y": torch.randint(0, 2, (12,), generator=g)}


class GraphLike(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        logits = self.net(batch["x"]).repeat(2, 1)[:12]  # 10 nodes, 12 labels
        return F.cross_entropy(logits, batch["y"])

    def train_dataloader(self):
        return DataLoader(_Graph(), batch_size=None)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_batch_without_a_batch_dimension_falls_back_with_one_warning() -> None:
    cb = _callback(noise_ratio=0.5)
    with pytest.warns(
        UserWarning, match="noise-relative budget needs the batch's two halves"
    ) as rec:
        fit(GraphLike(), [cb], max_steps=4)
    assert sum("two halves" in str(w.message) for w in rec) == 1
    assert cb.policy.metrics()["error_target"] == cb.policy.fallback_error
