"""``EngineSettings.remake_products``: Linear and convolution outputs remade at unpack
(the default) or stored through the policy's codecs (``False``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_acgc import ActivationCompression, compress_activations
from lightning_acgc.codecs.spec import CodecSpec
from lightning_acgc.engine import ActivationCompressor, EngineSettings
from lightning_acgc.engine.derive import Origin, derive_plan
from lightning_acgc.engine.step import compressed_step
from lightning_acgc.policies.acgc import ACGCPolicy
from tests.test_derive import Deriving
from tests.test_derive_linear import Attention, _x

PRODUCTS = ("linear of", "conv of")  # the settings a remade product is recorded with


class Block(nn.Module):
    """Attention (q, k, v remade as products), a LayerNorm (remade elementwise from its
    input) and a GELU feed-forward (its pre-activation a product)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.attn, self.norm = Attention(dim), nn.LayerNorm(dim)
        self.up, self.act, self.down = nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x + self.attn(x))
        return h + self.down(self.act(self.up(h)))


def _sites(remake: bool, spec: CodecSpec | None) -> tuple[dict, list[torch.Tensor], int]:
    """Site records, gradients and kept bytes of one step of :class:`Block` under a
    deriving policy with ``remake_products=remake``."""
    torch.manual_seed(0)
    model, x = Block(), _x()
    options = {"min_numel": 0, "remake_products": remake, "compress_loss": True}
    with compress_activations(model=model, policy=Deriving(spec), **options) as stats:
        loss = model(x).square().mean()  # the loss's tensor: the policy's too
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return dict(stats.sites), grads, stats.packed_bytes


def _products(sites: dict) -> list[str]:
    """The sites remade as a Linear's or a convolution's product."""
    return sorted(
        k for k, r in sites.items() if r.codec == "recomputed" and r.settings.startswith(PRODUCTS)
    )


def _elementwise(sites: dict) -> list[str]:
    """The other sites remade (a LayerNorm's, an activation's output)."""
    products = set(_products(sites))
    return sorted(k for k, r in sites.items() if r.codec == "recomputed" and k not in products)


def test_default_remakes_products_and_the_setting_stores_them() -> None:
    spec = CodecSpec("quant", {"bits": 8})
    remade, _, kept_remade = _sites(True, spec)
    stored, _, kept_stored = _sites(False, spec)
    assert len(_products(remade)) >= 4  # q, kᵀ, v and the feed-forward's pre-activation
    assert _products(stored) == []
    for key in _products(remade):  # each is now held by a codec, bytes charged to it
        assert stored[key].codec != "recomputed" and stored[key].packed_bytes > 0
    # the cheap derivations (a LayerNorm's or an activation's output) stay remade
    assert _elementwise(stored) and set(_elementwise(stored)) <= set(_elementwise(remade))
    assert kept_stored > kept_remade


def test_stored_products_kept_as_they_are_give_plain_gradients() -> None:
    """With every tensor kept (no codec), storing the products changes nothing."""
    torch.manual_seed(0)
    model, x = Block(), _x()
    model(x).square().mean().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    for remake in (True, False):
        _, got, _ = _sites(remake, None)
        for a, b in zip(plain, got, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_acgc_keeps_its_promise_with_stored_products() -> None:
    """acgc allocates widths to the stored products too: the measured error of its
    calibrations stays within e, and no product is remade."""
    torch.manual_seed(0)
    model, x = Block(), _x(shape=(8, 16, 16))
    e = 0.1
    policy = ACGCPolicy(gradient_error=e, warmup_steps=4, calibrate_every=1000)
    settings = EngineSettings(min_numel=0, remake_products=False)
    engine = ActivationCompressor(policy, model=model, settings=settings)
    engine.install()
    policy.setup(model)
    errors = []
    try:
        for step in range(4):
            model.zero_grad()
            compressed_step(engine, model, lambda: model(x).square().mean(), step=step)
            errors.append(policy.metrics()["grad_error"])
        sites = dict(engine.stats.sites)
    finally:
        engine.remove()
    assert max(errors) <= e, errors
    assert _products(sites) == []
    assert any(r.codec == "quant" for r in sites.values())


def test_the_callback_passes_the_setting() -> None:
    assert EngineSettings().remake_products
    assert not ActivationCompression(remake_products=False).settings.remake_products
    assert ActivationCompression().settings.remake_products


@pytest.mark.parametrize("remake", [True, False])
def test_resnet_block_trains_either_way(remake: bool) -> None:
    """A convolution's output saved by its BatchNorm: remade or stored, the step's
    gradients are finite and close to plain's at 8 bits."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))  # fmt: skip
    x = torch.randn(4, 3, 8, 8)
    model(x).square().mean().backward()
    plain = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    model.zero_grad()
    spec = CodecSpec("quant", {"bits": 8})
    with compress_activations(
        model=model, policy=Deriving(spec), min_numel=0, remake_products=remake
    ) as stats:
        loss = model(x).square().mean()
    loss.backward()
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert torch.isfinite(got).all()
    assert (got - plain).norm() <= 0.05 * plain.norm()
    assert bool(_products(dict(stats.sites))) is remake


def test_plans_offer_no_product_when_products_are_off() -> None:
    lin, conv = nn.Linear(8, 4), nn.Conv2d(2, 3, 3)
    x, img = torch.randn(6, 8, requires_grad=True), torch.randn(1, 2, 5, 5, requires_grad=True)
    for out, source in ((lin(x), x), (conv(img), img)):
        assert derive_plan(out, [Origin.of(source)]) is not None
        assert derive_plan(out, [Origin.of(source)], products=False) is None
