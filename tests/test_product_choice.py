"""Which products are remade where one blocks another (lightning_acgc.engine.product_choice):
a product yields to a later one that saves at least as many values for at most as many
multiplies each, from the next step on."""

from __future__ import annotations

import torch
from torch import nn

from lightning_acgc.engine import ActivationCompressor, EngineSettings
from lightning_acgc.engine.product_choice import ProductChoice
from tests.test_derive import Deriving


def test_a_dominated_blocker_yields():
    choice = ProductChoice()
    choice.made("a:0", values=64, multiplies=72)
    choice.blocked(values=256, multiplies=8, by=["a:0"])
    assert not choice.allowed("a:0")
    choice.forget()
    assert choice.allowed("a:0")


def test_equal_or_mixed_products_keep_the_forward_order():
    choice = ProductChoice()
    choice.made("a:0", values=64, multiplies=72)
    choice.blocked(values=64, multiplies=72, by=["a:0"])  # ResNet-18: equal 3x3 convs
    choice.blocked(values=512, multiplies=144, by=["a:0"])  # more values, dearer each
    choice.blocked(values=32, multiplies=8, by=["a:0"])  # cheaper, fewer values
    assert choice.allowed("a:0")


def test_nothing_yields_to_a_product_blocked_by_other_tensors_too():
    choice = ProductChoice()
    choice.made("a:0", values=64, multiplies=72)
    choice.blocked(values=256, multiplies=8, by=["a:0", "gelu:0"])  # gelu: not a product
    assert choice.allowed("a:0")
    choice.made("b:0", values=512, multiplies=8)
    choice.blocked(values=256, multiplies=8, by=["a:0", "b:0"])  # b is not dominated
    assert choice.allowed("a:0") and choice.allowed("b:0")


class Bottleneck(nn.Module):
    """A 3x3 convolution, then a 1x1 one with four times its channels, each followed by a
    BatchNorm (which saves the convolution's output) and a ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 32, 1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x * 1.0)


def _step(engine: ActivationCompressor, model: nn.Module, x: torch.Tensor):
    engine.new_step()
    model.zero_grad()
    with engine.scope() as stats:
        loss = model(x).square().mean()
    loss.backward()
    remade = {k for k, r in stats.sites.items() if r.settings.startswith("conv of")}
    return remade, [p.grad.clone() for p in model.parameters()]


def test_the_wider_pointwise_product_is_remade_from_the_second_step():
    torch.manual_seed(0)
    model, x = Bottleneck(), torch.randn(4, 8, 10, 10, requires_grad=True)
    model(x).square().mean().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    engine = ActivationCompressor(
        Deriving(None), model=model, settings=EngineSettings(compress_loss=True)
    )
    engine.install()
    try:
        first, _ = _step(engine, model, x)
        second, grads = _step(engine, model, x)
        third, _ = _step(engine, model, x)
    finally:
        engine.remove()
    assert first == {"body.1:0"}  # greedy: the 3x3 output, which blocks the 1x1's
    assert second == third == {"body.4:0"}  # the 1x1 output: 4x the values, 1/9 the cost
    for a, b in zip(grads, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    engine.install()  # a new fit chooses again
    try:
        again, _ = _step(engine, model, x)
    finally:
        engine.remove()
    assert again == {"body.1:0"}
