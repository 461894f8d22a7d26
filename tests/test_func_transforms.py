"""training_step code that refuses saved-tensor hooks (``torch.func``): compression steps
aside for the fit, which then trains exactly as plain training does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _lightning_models import module_hook_count, saved_tensors_hooks_active, trainer_kwargs
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap
from torch.utils.data import DataLoader, TensorDataset

from lightning_acgc import ActivationCompression
from lightning_acgc.lightning.driver import refuses_hooks


class FuncLoss(LightningModule):
    """A small regression whose loss adds a penalty made by a ``torch.func`` transform:
    the input derivative (``jacrev``, a physics-informed loss) or per-sample gradient
    norms (``vmap(grad)``). ``manual`` steps the optimizer before the transform."""

    def __init__(self, transform: str = "jacrev", manual: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
        )
        self.transform = transform
        self.automatic_optimization = not manual
        g = torch.Generator().manual_seed(3)
        self._x = torch.randn(64, 8, generator=g)
        self._y = self._x.sum(1, keepdim=True).sin()

    def _penalty(self, x: torch.Tensor) -> torch.Tensor:
        if self.transform == "none":
            return x.new_zeros(())
        if self.transform == "jacrev":  # d net / d x at each point
            jac = vmap(jacrev(lambda xi: self.net(xi[None])[0]))(x)
            return jac.square().mean()
        params = {k: v.detach() for k, v in self.net.named_parameters()}

        def one(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(functional_call(self.net, p, (xi[None],))[0], yi)

        grads = vmap(grad(one), in_dims=(None, 0, 0))(params, x, self._y[: len(x)])
        return sum(g.square().sum() for g in grads.values()) * 1e-3

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if self.automatic_optimization:
            return loss + 0.1 * self._penalty(x)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return self._penalty(x).detach()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self._x, self._y), batch_size=16)


def _fit(model: LightningModule, callbacks: list) -> Trainer:
    trainer = Trainer(callbacks=callbacks, **trainer_kwargs(max_epochs=2))
    trainer.fit(model)
    return trainer


@pytest.mark.parametrize("transform", ["jacrev", "per_sample_grad"])
@pytest.mark.parametrize("policy", ["acgc", "fixed"])
def test_refusing_code_trains_as_plain(transform: str, policy: str) -> None:
    torch.manual_seed(0)
    plain = FuncLoss(transform)
    torch.manual_seed(0)
    compressed = FuncLoss(transform)
    _fit(plain, [])
    options = {"codec": "quant", "bits": 2} if policy == "fixed" else {}
    cb = ActivationCompression(policy=policy, print_table=False, **options)
    with pytest.warns(UserWarning, match="refuses saved-tensor hooks.*compression is off"):
        trainer = _fit(compressed, [cb])
    for (name, a), b in zip(
        plain.state_dict().items(), compressed.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name  # every step ran uncompressed, as plain
    assert module_hook_count(compressed) == 0 and not saved_tensors_hooks_active()
    assert "training_step" not in trainer.strategy.__dict__
    # the callback fits another model afterwards, compressing it
    other = FuncLoss("none")
    _fit(other, [cb])
    assert cb.stats.tensors_packed > 0


def test_refusal_after_an_optimizer_step_says_why() -> None:
    model = FuncLoss("jacrev", manual=True)
    cb = ActivationCompression(policy="fixed", codec="quant", bits=2, print_table=False)
    trainer = Trainer(callbacks=[cb], **trainer_kwargs(max_epochs=1))
    with pytest.raises(RuntimeError, match="after an optimizer step") as info:
        trainer.fit(model)
    assert refuses_hooks(info.value.__cause__)
    assert module_hook_count(model) == 0 and not saved_tensors_hooks_active()


def test_refusal_in_the_batch_search_skips_the_search() -> None:
    model = FuncLoss("jacrev")
    model.batch_size = 16
    cb = ActivationCompression(scale_batch_size="power", memory_budget="64MB", print_table=False)
    with pytest.warns(UserWarning, match="compression is off"):
        _fit(model, [cb])
    assert model.batch_size == 16  # no search ran
    assert cb.batch_size_finder.compressed_batch_size is None
    assert module_hook_count(model) == 0 and not saved_tensors_hooks_active()


def test_refusal_under_the_compression_strategy() -> None:
    torch.manual_seed(0)
    plain = FuncLoss("jacrev")
    torch.manual_seed(0)
    compressed = FuncLoss("jacrev")
    _fit(plain, [])
    trainer = Trainer(strategy="acgc", **trainer_kwargs(max_epochs=2))
    with pytest.warns(UserWarning, match="compression is off"):
        trainer.fit(compressed)
    for a, b in zip(plain.state_dict().values(), compressed.state_dict().values(), strict=True):
        assert torch.equal(a, b)
