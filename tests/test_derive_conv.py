"""Convolution outputs (a ResNet's BatchNorm inputs) remade at unpack from the
convolution's saved input (lightning_acgc.engine.derive_conv), for policies that derive
outputs (acgc); no chain of products runs again back to the first stored tensor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_acgc import compress_activations
from lightning_acgc.codecs.spec import CodecSpec
from lightning_acgc.engine.derive import Origin, derive_plan
from lightning_acgc.engine.derive_conv import conv_gain, conv_output
from tests.test_derive import (
    Deriving,
    _grads,
    assert_second_backward_and_freed_memory,
    derived_matches_plain,
)


def _x(shape=(4, 3, 10, 10), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2).requires_grad_()


CONVS = {
    "3x3": lambda: nn.Conv2d(3, 8, 3, padding=1),
    "strided_no_bias": lambda: nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False),
    "dilated": lambda: nn.Conv2d(3, 6, 3, padding=2, dilation=2),
    "grouped": lambda: nn.Conv2d(3, 6, 1, groups=3),
    "conv1d": lambda: nn.Conv1d(3, 5, 3),
}


@pytest.mark.parametrize("name", sorted(CONVS))
def test_plan_remakes_the_output(name):
    torch.manual_seed(0)
    conv = CONVS[name]()
    x = _x((4, 3, 10) if name == "conv1d" else (4, 3, 10, 10)) * 1.0
    y = conv(x)
    plan = conv_output(y, y, [Origin.of(torch.zeros(2)), Origin.of(x)])
    assert plan is not None and plan.sources == (1,) and plan.name == "conv" and plan.multiplies
    torch.testing.assert_close(plan.fn(x.detach()), y.detach(), rtol=0, atol=0)
    assert plan.gain(None) == pytest.approx(conv_gain(conv.weight))


def test_not_derived_where_it_cannot_be_remade_as_it_was():
    x = _x() * 1.0
    conv = nn.Conv2d(3, 4, 3)
    assert conv_output(conv(x), conv(x), []) is None  # the input was not saved
    up = nn.ConvTranspose2d(3, 4, 3)
    assert conv_output(up(x), up(x), [Origin.of(x)]) is None  # transposed
    conv.bias.requires_grad_(False)  # a bias with no edge to read it from
    assert conv_output(conv(x), conv(x), [Origin.of(x)]) is None
    conv.bias.requires_grad_(True)
    y = nn.functional.conv2d(x, conv.weight * 1.0, conv.bias)  # a computed weight
    assert conv_output(y, y, [Origin.of(x)]) is None


def test_gain_is_the_variance_factor_of_independent_errors():
    torch.manual_seed(0)
    w = torch.randn(8, 4, 3, 3) * 0.2
    delta = torch.randn(16, 4, 40, 40) * 0.01
    out = nn.functional.conv2d(delta, w)  # no padding: every output sees 36 inputs
    assert conv_gain(w) == pytest.approx(float(out.var() / delta.var()), rel=0.05)


class Stack(nn.Module):
    """Three conv-BN-ReLU layers: the BatchNorm inputs alternate between remade (from a
    stored input) and stored (their input is remade from a remade tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *(
                nn.Sequential(nn.Conv2d(c, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
                for c in (3, 8, 8)
            )
        )
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x * 1.0))


def test_kept_inputs_give_plain_gradients_and_no_chain_of_products():
    torch.manual_seed(0)
    stats = derived_matches_plain(Stack(), _x(), rtol=1e-5, atol=1e-6)
    conv = {k for k, r in stats.sites.items() if r.settings.startswith("conv of")}
    # the first BatchNorm's input from the stored x; the second's input would be remade
    # from the first ReLU's output, itself remade from a remade tensor: stored; the third's
    # from the second ReLU's output, remade from the stored second input
    assert conv == {"layers.0.1:0", "layers.2.1:0"}
    assert stats.sites["layers.1.1:0"].codec != "recomputed"


def test_rounded_input_gives_close_gradients_and_nan_survives():
    torch.manual_seed(0)
    model, x = Stack(), _x().detach()
    plain, _ = _grads(model, x.requires_grad_())
    got, _ = _grads(model, x, Deriving(CodecSpec("quant", {"bits": 8})))
    flat = [torch.cat([g.reshape(-1) for g in gs]) for gs in (plain, got)]
    assert (flat[1] - flat[0]).norm() <= 0.05 * flat[0].norm()
    poisoned = x.detach().clone()
    poisoned[0, 1, 2, 3] = float("nan")
    poisoned.requires_grad_()
    plain, _ = _grads(model, poisoned)
    got, _ = _grads(model, poisoned, Deriving(CodecSpec("quant", {"bits": 8})))
    for a, b in zip(plain, got, strict=True):
        assert torch.equal(a.isnan(), b.isnan())


def test_a_weight_changed_in_place_before_backward_is_an_error():
    torch.manual_seed(0)
    model, x = Stack(), _x()
    with compress_activations(model=model, policy=Deriving(None)):
        loss = model(x).square().mean()
    with torch.no_grad():
        model.layers[0][0].bias.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place between forward and backward"):
        loss.backward()


def test_second_backward_and_freed_memory():
    torch.manual_seed(0)
    assert_second_backward_and_freed_memory(
        Stack(), _x(), Deriving(CodecSpec("quant", {"bits": 8}))
    )


def test_derive_plan_reaches_the_convolution():
    conv = nn.Conv2d(3, 4, 3)
    x = _x() * 1.0
    y = conv(x)
    plan = derive_plan(y, [Origin.of(x)])
    assert plan is not None and plan.name == "conv"
