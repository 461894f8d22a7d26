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
from lightning_acgc.codecs import CodecSpec
from lightning_acgc.lightning.batch_size import CompressedBatchSizeFinder
from lightning_acgc.lightning.halves import split_batch
from tests._lightning_models import ManualTwoForward, ProbePolicy, TinyCNN, TinyMLP, fit


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
        trainer = fit(GraphLike(), [cb], max_steps=4)
    messages = [str(w.message) for w in rec if "two halves" in str(w.message)]
    assert len(messages) == 1  # 4 calibration steps (every step), one warning
    assert "falls back to the policy's fixed error 0.05" in messages[0]
    assert "tuple, list or dict of tensors sharing their first (batch) dimension" in messages[0]
    assert trainer.global_step == 4  # training went on
    assert cb.policy.metrics()["error_target"] == cb.policy.fallback_error


# -- the cut itself: values, nesting, leaves kept -------------------------------------
def test_split_batch_halves_rejoin_to_the_batch_and_keep_other_leaves() -> None:
    x, y = torch.randn(7, 3), torch.arange(7)
    batch = [(x, "ids"), {"y": y, "n": 7, "none": None}]
    first, second = split_batch(batch)
    assert torch.equal(torch.cat([first[0][0], second[0][0]]), x)
    assert torch.equal(first[1]["y"], y[:3]) and torch.equal(second[1]["y"], y[3:])
    for half in (first, second):
        assert type(half) is list and type(half[0]) is tuple
        assert half[0][1] == "ids" and half[1]["n"] == 7 and half[1]["none"] is None


# -- the budget: e = min(e_noise, gradient_error or max_error), as plain PyTorch ------
@pytest.mark.parametrize("gradient_error", [None, 0.3, 0.01])
def test_error_target_is_the_tighter_of_noise_and_fixed_bound(
    gradient_error: float | None,
) -> None:
    cb = _callback(noise_ratio=0.5, gradient_error=gradient_error)
    fit(Regression(batch=512), [cb], max_steps=4)
    metrics, policy = cb.policy.metrics(), cb.policy
    assert metrics["noise_error"] > 0
    cap = min(gradient_error or policy.max_error, policy.max_error)
    assert metrics["error_target"] == pytest.approx(min(metrics["noise_error"], cap))
    if gradient_error == 0.01:  # the fixed bound is the tighter here (e_noise ≈ 0.22)
        assert metrics["error_target"] == pytest.approx(0.01)
    else:
        assert metrics["error_target"] == pytest.approx(metrics["noise_error"])


@pytest.mark.parametrize("batch", [256, 1024])
def test_lightning_reproduces_the_plain_pytorch_budget(batch: int) -> None:
    """The same closed form as ``compressed_step(..., loss_halves=...)`` reaches, and
    close to what that plain-PyTorch loop measures on its own data."""
    from tests.test_acgc_quant import _regression

    expected, history = _regression(batch)
    cb = _callback(noise_ratio=0.5, warmup_steps=1)
    fit(Regression(batch=batch), [cb], max_steps=6)
    got = cb.policy.metrics()["error_target"]
    assert got == pytest.approx(expected, rel=0.25)
    assert got == pytest.approx(history[-1]["error_target"], rel=0.25)


def test_hydra_config_passes_noise_ratio_to_the_policy() -> None:
    from hydra.utils import instantiate

    from recipes.config_schema import compose_config

    overrides = ["compression=acgc", "compression.noise_ratio=0.5"]
    cb = instantiate(compose_config(overrides).compression)
    assert cb.policy.noise_ratio == 0.5 and cb.policy.gradient_error == 0.05  # the tighter holds
    cb = instantiate(compose_config([*overrides, "compression.gradient_error=null"]).compression)
    assert cb.policy.noise_ratio == 0.5 and cb.policy.gradient_error is None
    assert instantiate(compose_config(["compression=acgc"]).compression).policy.noise_ratio is None


# -- how often training_step runs (README, "Calibration steps") -----------------------
class CountingMLP(TinyMLP):
    """Records each ``training_step`` call: (re-run for calibration?, batch size)."""

    def __init__(self) -> None:
        super().__init__(samples=64, batch_size=8)
        self.calls: list[tuple[bool, int]] = []

    def training_step(self, batch, batch_idx):
        self.calls.append((getattr(self, "acgc_calibrating", False), batch[0].shape[0]))
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(("noise_ratio", "accumulate", "total"), [
    (None, 1, 17), (None, 2, 34), (0.5, 1, 27), (0.5, 2, 44),
])  # fmt: skip
def test_training_step_calls_with_and_without_noise_ratio(
    noise_ratio: float | None, accumulate: int, total: int
) -> None:
    """12 steps with calibrate_every=5 calibrate at steps 0, 1, 2, 5, 10: the README's
    17 (34) calls, and 2 more per calibration step (on its first batch's halves, 4
    samples each) with noise_ratio."""
    model = CountingMLP()
    cb = ActivationCompression(
        policy="acgc", calibrate_every=5, min_numel=0, print_table=False, noise_ratio=noise_ratio
    )
    fit(model, [cb], max_steps=12, max_epochs=-1, accumulate_grad_batches=accumulate)
    assert len(model.calls) == total
    halves = [c for c in model.calls if c == (True, 4)]
    assert len(halves) == (0 if noise_ratio is None else 2 * 5)
    assert model.calls.count((False, 8)) == 12 * accumulate  # the compressed calls
    assert model.calls.count((True, 8)) == 5 * accumulate  # the exact gradients


# -- the order of the calls: halves before the exact gradient, once per step ----------
class NoiseProbe(ProbePolicy):
    """A :class:`ProbePolicy` that also wants the halves' gradients on its exact steps."""

    name = "noise_probe"

    def __init__(self, exact_every: int = 2) -> None:
        super().__init__(CodecSpec("quant", {"bits": 4}), exact_every)
        self.halves: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []

    def needs_noise_estimate(self, step: int) -> bool:
        return self.needs_exact_gradient(step)

    def set_noise_gradients(self, first: dict, second: dict, reduce: object = None) -> None:
        self.calls.append(("noise", len(first)))
        self.halves.append((first, second))

    def set_exact_gradients(self, grads: dict[str, torch.Tensor], reduce: object = None) -> None:
        super().set_exact_gradients(grads, reduce)
        self.whole = grads


@pytest.mark.parametrize("accumulate", [1, 2])
def test_halves_come_first_and_once_a_step(accumulate: int) -> None:
    policy = NoiseProbe(exact_every=2)
    fit(
        TinyMLP(samples=64, batch_size=8),
        [ActivationCompression(policy, print_table=False)],
        max_steps=4,
        accumulate_grad_batches=accumulate,
    )
    steps = [c for c in policy.calls if c[0] in ("begin", "noise", "exact", "end")]
    params = len(policy.halves[0][0])
    assert steps == [
        ("begin", 0), ("noise", params), ("exact", params), ("end", 0),
        ("begin", 1), ("end", 1),
        ("begin", 2), ("noise", params), ("exact", params), ("end", 2),
        ("begin", 3), ("end", 3),
    ]  # fmt: skip
    if accumulate == 1:  # the mean loss of two equal halves: their gradients average to g
        first, second = policy.halves[-1]
        for name, g in policy.whole.items():
            torch.testing.assert_close((first[name] + second[name]) / 2, g)


def test_calibration_step_before_the_batch_search_gets_the_halves(tmp_path) -> None:
    policy = NoiseProbe(exact_every=1000)
    finder = CompressedBatchSizeFinder("power", steps_per_trial=1, compare_uncompressed=False)
    cb = ActivationCompression(
        policy, scale_batch_size=finder, memory_budget="256KiB", print_table=False
    )
    fit(TinyCNN(), [cb], max_steps=1, default_root_dir=str(tmp_path))
    params = len(policy.halves[0][0])
    assert policy.calls[:6] == [
        ("setup", "TinyCNN"),
        ("begin", 0),
        ("noise", params),  # on the first batch of 2 samples, cut into 1 + 1
        ("exact", params),
        ("end", 0),
        ("begin", 0),
    ]
    # then the fit's first step played ahead at the size found, and that step itself
    assert policy.calls.count(("noise", params)) == 3


def test_manual_optimization_computes_no_halves() -> None:
    policy = NoiseProbe(exact_every=1)
    with pytest.warns(UserWarning, match="automatic optimization"):
        fit(ManualTwoForward(), [ActivationCompression(policy, print_table=False)], max_steps=2)
    assert not any(c[0] in ("noise", "exact") for c in policy.calls)
