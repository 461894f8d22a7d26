"""BatchNorm outputs and ReLU-of-BatchNorm outputs remade at unpack from the BatchNorm's
saved input and exact statistics (lightning_acgc.engine.derive), for policies that set
``derives_elementwise`` (acgc). The ReLU's mask is kept exactly, at 1 bit a value."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_acgc import compress_activations
from lightning_acgc.codecs.spec import CodecSpec
from lightning_acgc.engine.derive import Origin, derive_plan
from lightning_acgc.kernels.mask import mask_pack
from lightning_acgc.policies.fixed import FixedPolicy
from tests.test_derive import (
    Deriving,
    _grads,
    acgc_after_calibration,
    assert_second_backward_and_freed_memory,
    derived_matches_plain,
)


class ConvBnRelu(nn.Module):
    """conv, BatchNorm, ReLU (in place), conv: the second conv saves the ReLU's output."""

    def __init__(self, affine: bool = True, track: bool = True) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8, affine=affine, track_running_stats=track)
        self.relu = nn.ReLU(inplace=True)
        self.b = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.relu(self.bn(self.a(x))))


def _inputs(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(4, 3, 12, 12, generator=g) * 2).requires_grad_()


def _saved_relu(model: ConvBnRelu, x: torch.Tensor, policy) -> torch.Tensor:
    """What the ReLU's backward unpacks as its output."""
    with compress_activations(model=model, policy=policy):
        out = model(x)
    node = out.grad_fn.next_functions[0][0]  # the second conv's input: the ReLU
    assert type(node).__name__ == "ReluBackward0"
    return node._saved_result


@pytest.mark.parametrize(
    ("affine", "track"), [(True, True), (False, True), (True, False), (False, False)]
)
def test_kept_input_gives_plain_gradients_and_stores_the_mask(affine, track):
    torch.manual_seed(0)
    model, x = ConvBnRelu(affine, track), _inputs()
    stats = derived_matches_plain(model, x, rtol=1e-5, atol=1e-6)
    relu = stats.sites["relu:0"]
    assert relu.codec == "recomputed" and relu.derived_from == "bn:0"
    assert relu.packed_bytes == 4 * 8 * 12 * 12 // 8  # the mask: 1 bit a value
    assert stats.sites["b:0"].shared_with == "relu:0"


def test_the_mask_is_exact_under_coarse_rounding():
    """At 2 bits the BatchNorm's input is far off, yet the ReLU passes the same elements:
    the unpacked output is positive exactly where the true output is, zero elsewhere."""
    torch.manual_seed(0)
    model, x = ConvBnRelu(), _inputs()
    with torch.no_grad():
        true = F.relu(model.bn(model.a(x)))
    y_hat = _saved_relu(model, x, Deriving(CodecSpec("quant", {"bits": 2})))
    assert torch.equal(y_hat > 0, true > 0)
    assert bool((y_hat[true == 0] == 0).all())
    err = float((y_hat - true).detach().norm() / true.norm())
    assert 0 < err < 1.0  # rounded values (2 bits), not the exact ones


def test_nan_survives_the_derivation():
    torch.manual_seed(0)
    model, x = ConvBnRelu(), _inputs()
    with torch.no_grad():
        model.a.bias[2] = float("nan")  # its channel: NaN after the BatchNorm
        model.a.bias[5] = float("inf")  # inf - mean(inf) is NaN too
    y_hat = _saved_relu(model, x, Deriving(CodecSpec("quant", {"bits": 8})))
    assert y_hat[:, 2].isnan().all() and y_hat[:, 5].isnan().all()
    assert not y_hat[:, [0, 1, 3, 4, 6, 7]].isnan().any()


def test_gain_is_the_passed_share_of_the_channels_squared_scale():
    torch.manual_seed(0)
    model, x = ConvBnRelu(), _inputs()
    with torch.no_grad():
        model.bn.weight.copy_(torch.linspace(0.5, 2.0, 8))
    _, stats = _grads(model, x, Deriving(CodecSpec("quant", {"bits": 8})))
    with torch.no_grad():
        h = model.a(x)
        var = h.var(dim=(0, 2, 3), unbiased=False)
        rstd2 = 1.0 / (var + model.bn.eps)
        passed = (F.relu(model.bn(h)) > 0).sum(dim=(0, 2, 3)).double()
        expected = float(
            (passed * rstd2.double() * model.bn.weight.double() ** 2).sum() / h.numel()
        )
    assert stats.sites["relu:0"].gain == pytest.approx(expected, rel=1e-4)


def test_a_batch_norm_output_saved_by_the_next_op_is_derived():
    """BatchNorm1d, then GELU (it saves its input: the BatchNorm's output), then Linear
    (it saves the GELU's output): both remade from the BatchNorm's input, as a chain."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.GELU(), nn.Linear(32, 4))
    x = torch.randn(64, 16).requires_grad_()
    stats = derived_matches_plain(model, x, rtol=1e-5, atol=1e-6)
    assert stats.sites["2:0"].codec == "recomputed" and stats.sites["2:0"].derived_from == "1:0"
    assert stats.sites["3:0"].codec == "recomputed" and stats.sites["3:0"].derived_from == "2:0"
    assert stats.sites["2:0"].packed_bytes == 0  # no mask: nothing stored


def test_eval_mode_is_not_derived():
    torch.manual_seed(0)
    model, x = ConvBnRelu(), _inputs()
    policy = Deriving(CodecSpec("quant", {"bits": 8}))
    model.eval()  # running statistics: the saved mean and 1/σ are empty
    _, stats = _grads(model, x, policy)
    assert stats.sites["relu:0"].codec != "recomputed"
    model.train()
    _, stats = _grads(model, x, FixedPolicy(CodecSpec("quant", {"bits": 8})))
    assert stats.sites["relu:0"].codec != "recomputed"  # the policy does not ask


def test_saves_between_the_norm_and_the_relu_do_not_confuse_its_statistics():
    """Another op saves tensors of the statistics' shape between the BatchNorm and the
    ReLU: the statistics are found by the BatchNorm's own order of saves."""

    class Between(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn, self.lin = nn.BatchNorm1d(16), nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.bn(x * 1.0)
            other = torch.sin(x[0] * 2.0) * torch.cos(x[1] * 3.0)  # (16,)-shaped saves
            return self.lin(torch.relu(y)) + other

    torch.manual_seed(0)
    model, x = Between(), torch.randn(32, 16).requires_grad_()
    stats = derived_matches_plain(model, x, rtol=1e-5, atol=1e-6)
    assert stats.sites["lin:0"].codec == "recomputed"


def test_derive_plan_of_a_relu_needs_a_batch_norm_input():
    x = torch.randn(4, 6, 5, requires_grad=True)
    h = x * 2
    assert derive_plan(torch.relu(h), [Origin.of(h)]) is None  # a Mul's output: kept
    bn = nn.BatchNorm1d(6)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(Origin.of(t)) or t, lambda t: t
    ):
        y = bn(h)
    z = torch.relu(y)
    plan = derive_plan(z, saved)
    assert plan is not None and plan.name == "relu of batch_norm" and plan.kept is not None
    assert torch.equal(plan.kept, mask_pack(~(y <= 0)))  # the ReLU's mask, packed
    assert plan.sources == (0, len(saved) - 2, len(saved) - 1)
    assert derive_plan(z, saved[:-1]) is None  # 1/σ missing


def test_second_backward_and_freed_memory():
    torch.manual_seed(0)
    model, x = ConvBnRelu(), _inputs()
    assert_second_backward_and_freed_memory(model, x, Deriving(CodecSpec("quant", {"bits": 4})))


def test_acgc_on_a_resnet_block_keeps_its_promise():
    """acgc on two blocks of conv-BN-ReLU-conv-BN + identity, ReLU: each first ReLU's
    output is remade (no width of its own), and so is each first BatchNorm's input (the
    convolution run again from its stored input), the residual sums every other block;
    the promise holds."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1, self.n1 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
            self.c2, self.n2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
            self.r1, self.r2 = nn.ReLU(inplace=True), nn.ReLU(inplace=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.r2(self.n2(self.c2(self.r1(self.n1(self.c1(x))))) + x)

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), Block(), Block(), nn.Flatten(), nn.Linear(8 * 64, 4)
    )
    sites, policy, error = acgc_after_calibration(model, torch.randn(16, 3, 8, 8))
    # (the second block's input is the first's sum, held by the first's ReLU: 1.r2:0)
    for block, conv_input in (("1", "1.c1:0"), ("2", "1.r2:0")):
        r1, n1 = sites[f"{block}.r1:0"], sites[f"{block}.n1:0"]
        assert r1.codec == "recomputed" and r1.derived_from == f"{block}.n1:0"
        assert n1.codec == "recomputed" and n1.derived_from == conv_input
        assert n1.settings.startswith("conv of") and n1.gain > 0
        assert not {f"{block}.n1:0", f"{block}.r1:0"} & set(policy.site_bits)
        # the second BatchNorm's input would be remade from r1, remade from a remade
        # tensor: stored (no chain of convolutions)
        assert f"{block}.n2:0" in policy.site_bits
    # the first block's sum is remade from its BatchNorm's input and the block's input
    # (stored); the second's input is that remade sum: it is stored (no chains)
    r2 = sites["1.r2:0"]
    assert r2.codec == "recomputed" and r2.derived_from == "1.n2:0"
    assert [k for k, _ in r2.also_from] == ["1.c1:0"] and 0 < r2.also_from[0][1] <= 1
    assert sites["2.r2:0"].codec != "recomputed"
    assert "1.c1:0" in policy.site_bits and "2.r2:0" in policy.site_bits
    assert policy.metrics()["grad_error"] <= 0.1
    assert error <= 0.1


class Residual(nn.Module):
    """Two bottleneck-like blocks: a projection shortcut (BatchNorm + BatchNorm, ReLU),
    then an identity one (BatchNorm + the block's input, ReLU)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.n1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.s, self.ns = nn.Conv2d(3, 8, 1, bias=False), nn.BatchNorm2d(8)
        self.c2, self.n2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.n1(self.c1(x)) + self.ns(self.s(x)))
        b = torch.relu(self.n2(self.c2(a)) + a)
        return self.head(b)


def test_residual_sums_give_plain_gradients_and_keep_the_mask():
    torch.manual_seed(0)
    model, x = Residual(), _inputs()
    plain, _ = _grads(model, x)
    derived, stats = _grads(model, x, Deriving(None))
    for a, b in zip(derived, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    sums = {k: r for k, r in stats.sites.items() if r.settings.startswith("relu of a residual")}
    assert len(sums) == 1  # the second sum's input is the first (remade): stored
    (first,) = sums.values()
    assert first.derived_from == "n1:0" and [k for k, _ in first.also_from] == ["ns:0"]
    assert first.packed_bytes == x.shape[0] * 8 * 12 * 12 // 8
    # coarse rounding of both BatchNorms' inputs: the ReLU's mask stays exact
    with compress_activations(model=model, policy=Deriving(CodecSpec("quant", {"bits": 2}))):
        out = model(x)
    node = out.grad_fn.next_functions[0][0]  # the head's input: the second ReLU's output
    while type(node).__name__ != "ReluBackward0":
        node = node.next_functions[0][0]
    add = node.next_functions[0][0]
    first_relu = add.next_functions[1][0]  # the identity: the first ReLU's output
    with torch.no_grad():
        true = torch.relu(model.n1(model.c1(x)) + model.ns(model.s(x)))
    y_hat = first_relu._saved_result
    assert torch.equal(y_hat > 0, true > 0) and bool((y_hat[true == 0] == 0).all())


def test_sensitivity_of_a_residual_sum_reaches_both_sides():
    from lightning_acgc.engine.meter import SiteRecord
    from lightning_acgc.policies.error_model import tensor_sensitivities

    def rec(key, module, module_type, codec="recomputed", **extra):
        r = SiteRecord(key, module, module_type, (8, 4), "float32", codec, "")
        for k, v in extra.items():
            setattr(r, k, v)
        return r

    records = {
        "bn:0": rec("bn:0", "bn", "BatchNorm2d", "quant"),
        "x:0": rec("x:0", "x", "Conv2d", "quant"),
        "relu:0": rec(
            "relu:0", "relu", "ReLU", derived_from="bn:0", gain=2.0, also_from=(("x:0", 0.5),)
        ),
        "fc:0": rec("fc:0", "fc", "Conv2d", shared_with="relu:0"),
    }
    sens = tensor_sensitivities(
        records, {"fc": 3.0, "relu": 1.0, "bn": 1.0, "x": 1.0}, {"fc": 4, "x": 4}
    )
    assert sens["bn:0"].weight_by_module["fc"] == pytest.approx(2.0 * 4 * 3.0)
    assert sens["x:0"].weight_by_module["fc"] == pytest.approx(0.5 * 4 * 3.0)


class _TorchvisionBasicBlock(nn.Module):
    """torchvision's BasicBlock as written there: one ReLU module (in place) for both
    calls, the shortcut added in place (``out += identity``), a downsample Sequential."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1, self.relu = nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        out += identity
        return self.relu(out)


def test_torchvision_style_blocks_give_plain_gradients_with_their_sums_remade():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.MaxPool2d(2), _TorchvisionBasicBlock(8, 8, 1), _TorchvisionBasicBlock(8, 8, 1),
        _TorchvisionBasicBlock(8, 16, 2), _TorchvisionBasicBlock(16, 16, 1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4),
    )  # fmt: skip
    stats = derived_matches_plain(model, _inputs(), rtol=1e-4, atol=1e-6)
    sums = [k for k, r in stats.sites.items() if r.settings.startswith("relu of a residual")]
    # the stem's input is stored: block 4 remade; 5's input is that: stored; 6 has a
    # projection (both addends BatchNorms): remade; 7's input is 6's: stored
    assert sorted(sums) == ["4.relu:1", "6.relu:1"], sums


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(8, 5),
        lambda: torch.randn(4, 5, 7),
        lambda: torch.randn(2, 5, 6, 6),
        lambda: torch.randn(2, 5, 6, 6).to(memory_format=torch.channels_last),
        lambda: torch.randn(2, 6, 5, 6).transpose(1, 2),  # not contiguous
        lambda: torch.randn(2, 5, 3, 4, 4),
        lambda: torch.tensor([[1.0, float("nan")], [float("inf"), -2.0]]),
        lambda: torch.randn(2, 5, 4, 4, dtype=torch.float64),
        lambda: torch.randn(2, 5, 4, 4).to(torch.bfloat16),  # scale in float32: addcmul
    ],
    ids=["2d", "3d", "4d", "channels_last", "strided", "5d", "nan_inf", "float64", "bf16"],
)
def test_the_remade_normalisation_is_x_times_scale_plus_shift(make):
    """The remade output, whichever way it is computed, is x·scale + shift per channel
    (the BatchNorm's own scale and shift from its statistics), NaN and inf included."""
    from lightning_acgc.engine.derive_batch_norm import _normalized, _scale_shift

    torch.manual_seed(0)
    x = make()
    c = x.shape[1]
    mean, rstd = torch.randn(c), torch.rand(c) + 0.5
    weight, bias = torch.randn(c), torch.randn(c)
    if x.dtype == torch.float64:
        mean, rstd, weight, bias = (t.double() for t in (mean, rstd, weight, bias))
    got = _normalized(x, mean, rstd, weight, bias)
    scale, shift = _scale_shift(mean, rstd, weight, bias)
    shape = (1, -1, *(1,) * (x.dim() - 2))
    expected = x * scale.view(shape) + shift.view(shape)
    assert got.shape == x.shape and got.dtype == expected.dtype
    assert torch.equal(got.isnan(), expected.isnan())
    finite = expected.isfinite()
    assert torch.equal(got[~finite & ~expected.isnan()], expected[~finite & ~expected.isnan()])
    torch.testing.assert_close(got[finite], expected[finite], rtol=1e-6, atol=1e-6)
