"""Compression under autocast (Lightning's ``precision="bf16-mixed"``): the weights an op
uses are bf16 copies of the parameters, made by autograd-tracked casts and saved in their
place. They are the weights, not activations: kept as they are (a lossy copy changes
every gradient through the op), and read back through the cast where acgc remakes a
convolution's or a Linear's output (lightning_acgc.engine.derive_conv, derive_linear)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_acgc import ActivationCompression, compress_activations
from lightning_acgc.engine.derive import Origin
from lightning_acgc.engine.derive_conv import conv_gain, conv_output
from lightning_acgc.engine.derive_linear import linear_gain, linear_output
from lightning_acgc.engine.param_casts import FrozenParameters, cast_parameter
from tests._lightning_models import fit
from tests.test_unusual_models import Classifier

BF16 = torch.bfloat16


def _autocast() -> torch.autocast:
    return torch.autocast("cpu", dtype=BF16)


def _bf16_input(*shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(*shape, generator=g) * 2).to(BF16).requires_grad_() * 1.0


@pytest.mark.parametrize("bias", [True, False])
def test_conv_output_remade_through_autocast_casts(bias: bool) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 3, padding=1, bias=bias)
    x = _bf16_input(4, 3, 10, 10)
    with _autocast():
        y = conv(x)
    weight_edge = y.grad_fn.next_functions[1][0]  # autocast's copy, not the parameter
    assert y.dtype == BF16 and type(weight_edge).__name__ == "ToCopyBackward0"
    plan = conv_output(y, y, [Origin.of(x)])
    assert plan is not None and plan.name == "conv"
    torch.testing.assert_close(plan.fn(x.detach()), y.detach(), rtol=0, atol=0)
    assert plan.gain(None) == pytest.approx(conv_gain(conv.weight))


@pytest.mark.parametrize("bias", [True, False])
def test_linear_output_remade_through_autocast_casts(bias: bool) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(8, 6, bias=bias)
    x = _bf16_input(10, 8)
    with _autocast():
        y = lin(x)
    plan = linear_output(y, y, [Origin.of(x)])
    assert plan is not None and plan.name == "linear"
    torch.testing.assert_close(plan.fn(x.detach()), y.detach(), rtol=0, atol=0)
    assert plan.gain(None) == pytest.approx(linear_gain(lin.weight))


def test_parameter_casts_are_told_from_other_casts() -> None:
    w = nn.Parameter(torch.randn(4, 4))
    with _autocast():
        y = F.linear(torch.randn(2, 4), w)
    assert cast_parameter(w.to(BF16)) is w and cast_parameter(w.to(BF16).t()[1:]) is w
    assert cast_parameter((w * 2).to(BF16)) is None and cast_parameter(y) is None
    assert cast_parameter(w.detach().to(BF16)) is None  # no graph: nothing to tell it by


def test_a_computed_weight_is_still_not_remade_under_autocast() -> None:
    conv = nn.Conv2d(3, 4, 3)
    x = _bf16_input(2, 3, 8, 8)
    with _autocast():
        y = F.conv2d(x, conv.weight * 2.0, conv.bias)  # a cast of a computed tensor
    assert conv_output(y, y, [Origin.of(x)]) is None


@pytest.mark.parametrize("frozen", [False, True])
def test_weight_copies_are_kept_so_the_input_gradient_is_exact(frozen: bool) -> None:
    """A Linear's input gradient reads only its weight: at 1 bit a value everywhere else,
    it is still the exact one, and the table says why the weight's copy was kept. A frozen
    Linear's copy (a LoRA fine-tune's base weight) has no graph: told by shape and values."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 512).requires_grad_(not frozen)
    x = torch.randn(32, 64, requires_grad=True)
    with _autocast():
        lin(x).float().square().sum().backward()
    exact = x.grad.clone()
    x.grad = None
    with compress_activations(codec="quant", bits=1, model=lin) as stats, _autocast():
        lin(x).float().square().sum().backward()
    torch.testing.assert_close(x.grad, exact, rtol=0, atol=0)
    cast = [r for r in stats.sites.values() if r.settings == "cast again from its parameter"]
    assert cast and all(r.codec == "recomputed" and r.packed_bytes == 0 for r in cast)
    assert stats.tensors_packed > 0


def test_a_parameter_changed_in_place_before_backward_is_an_error() -> None:
    lin = nn.Linear(64, 512)
    x = torch.randn(32, 64, requires_grad=True)
    with compress_activations(codec="quant", bits=4, model=lin), _autocast():
        y = lin(x).float().square().sum()
        with torch.no_grad():
            lin.weight.add_(1.0)
        with pytest.raises(RuntimeError, match="modified in place between forward"):
            y.backward()


def test_a_frozen_parameter_is_read_again_each_step() -> None:
    lin = nn.Linear(8, 8)
    frozen = FrozenParameters(lin)
    copy = lin.weight.detach().to(BF16)
    assert frozen.copied(copy) is None  # it takes a gradient: its copy has a graph
    lin.requires_grad_(False)
    assert frozen.copied(copy) is None  # not read again yet
    frozen.refresh()
    assert frozen.copied(copy) is lin.weight and frozen.copied(copy * 2) is None
    assert frozen.copied(lin.weight.detach().clone()) is None  # its own dtype: not a copy


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _images() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 3, 16, 16, generator=g), torch.randint(0, 4, (64,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=16)


def test_acgc_under_bf16_mixed_remakes_the_batch_norm_inputs() -> None:
    torch.manual_seed(0)
    cb = ActivationCompression(print_table=False)
    fit(Classifier(ConvBN(), data=_images), [cb], max_steps=4, precision="bf16-mixed")
    sites = cb.stats.sites
    assert sites["net.net.4:0"].codec == "recomputed"  # the second BatchNorm's input
    weight = sites["net.net.3:1"]  # the second conv's weight: nothing held
    assert weight.settings == "cast again from its parameter" and weight.packed_bytes == 0
    assert cb.stats.ratio > 1.5


@pytest.mark.parametrize("view", [False, True])
def test_the_batch_s_16_bit_copy_is_cast_again_from_the_batch(view: bool) -> None:
    """A bf16 first layer saves autocast's copy of the batch, which plain autograd holds
    beside the batch: stored as nothing, cast again at unpack (bit-identical), and the
    first layer's weight gradient is the plain one at 1 bit a value everywhere else."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 32)
    x = torch.randn(4, 6, 16) if view else torch.randn(24, 16)  # 3-D: a view is saved
    with _autocast():
        lin(x).float().square().sum().backward()
    exact = lin.weight.grad.clone()
    lin.weight.grad = None
    with compress_activations(codec="quant", bits=1, model=lin, inputs=x) as stats, _autocast():
        lin(x).float().square().sum().backward()
    torch.testing.assert_close(lin.weight.grad, exact, rtol=0, atol=0)
    rec = stats.sites[":0"]  # (the root module's first site; its weight's copy is :1)
    assert rec.settings == "cast again from the step's input" and rec.packed_bytes == 0
    # not the batch (another tensor of its shape, no history): packed as usual
    with (
        compress_activations(codec="quant", bits=1, model=lin, inputs=torch.randn(24, 16)) as stats,
        _autocast(),
    ):
        lin(x).float().square().sum().backward()
    assert all(r.settings != "cast again from the step's input" for r in stats.sites.values())
