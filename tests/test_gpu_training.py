"""Training on a CUDA device: gradients of four architectures under each codec against the
exact gradient, every policy through a Lightning ``Trainer(accelerator="gpu")`` (fp32 and
bf16-mixed), and the peak of CUDA memory with and without compression. Skipped without a
CUDA device."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn

from lightning_acgc import ActivationCompression, compress_activations
from lightning_acgc.policies import available_policies
from tests._lightning_models import TinyCNN, fit, module_hook_count, saved_tensors_hooks_active
from tests._models import ARCHITECTURES, ResidualCNN, loss_of
from tests.test_gradients import _grad, _seed_runs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ARCHS = sorted(ARCHITECTURES)


def _to_cuda(inputs: object) -> object:
    if isinstance(inputs, tuple):
        return tuple(t.cuda() for t in inputs)
    return inputs.cuda()


def _model(name: str) -> tuple[nn.Module, object]:
    make_model, make_inputs = ARCHITECTURES[name]
    torch.manual_seed(0)
    return make_model().cuda(), _to_cuda(make_inputs())


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("arch", ARCHS)
def test_codecs_on_gpu_keep_the_gradient(arch: str) -> None:
    model, inputs = _model(arch)
    exact = _grad(model, inputs)
    identity = _grad(model, inputs, compress_activations(codec="identity", model=model))
    assert _rel_err(identity, exact) < 1e-5  # CUDA reductions may reorder
    ctx = compress_activations(codec="quant", bits=8, model=model, min_numel=64)
    with ctx as stats:
        q8 = _grad(model, inputs)
    assert stats.tensors_packed > 0
    assert _rel_err(q8, exact) < 0.05
    errors = []
    for eb in (1e-3, 1e-4):
        ctx = compress_activations(codec="bounded", error_bound=eb, model=model, min_numel=64)
        errors.append(_rel_err(_grad(model, inputs, ctx), exact))
    assert errors[1] < 1e-2 and errors[1] < errors[0] / 4, errors
    runs = _seed_runs(model, inputs, 16)
    assert _rel_err(torch.stack(runs).mean(0), exact) < _rel_err(runs[0], exact)
    division = compress_activations(codec="division", model=model, min_numel=64)
    assert math.isfinite(_rel_err(_grad(model, inputs, division), exact))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("policy", [p for p in available_policies() if p != "off"])
def test_every_policy_fits_on_gpu(policy: str, precision: str) -> None:
    model = TinyCNN(batch_size=32, samples=256)
    callback = ActivationCompression(policy, min_numel=256, print_table=False)
    trainer = fit(
        model,
        [callback],
        accelerator="gpu",
        max_steps=6,
        precision=precision,
        deterministic=False,
    )
    assert trainer.global_step == 6
    assert all(torch.isfinite(p).all() for p in model.parameters())
    stats = callback.stats
    assert stats is not None and stats.tensors_packed > 0 and stats.ratio > 1.5
    assert trainer.callback_metrics["acgc/ratio"].item() == pytest.approx(stats.ratio, rel=1e-6)
    assert module_hook_count(model) == 0 and not saved_tensors_hooks_active()


def test_gpu_peak_memory_falls_with_compression() -> None:
    """The forward's peak of CUDA memory falls by at least half of the activation bytes
    that compression frees (the rest: each layer's output before it is packed, cuDNN's
    workspace)."""
    model = ResidualCNN(width=64).cuda()
    x = torch.randn(64, 3, 64, 64, device="cuda")

    def peak(ctx=None) -> int:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with ctx if ctx is not None else contextlib.nullcontext():
            loss = loss_of(model, x)
            torch.cuda.synchronize()
            forward_peak = torch.cuda.max_memory_allocated() - base
            loss.backward()
        return forward_peak

    peak()  # warm up cuDNN and the Triton kernels
    peak(compress_activations(codec="quant", bits=2, model=model))
    plain = peak()
    with compress_activations(codec="quant", bits=2, model=model) as stats:
        compressed = peak(contextlib.nullcontext())
    assert stats.ratio > 8
    freed = stats.saved_bytes - stats.packed_bytes
    assert compressed < plain - freed / 2, (compressed, plain, freed)


def test_acgc_prices_the_fp32_metadata_that_cuda_writes() -> None:
    from lightning_acgc.policies import build_policy

    policy = build_policy("acgc")
    policy.setup(ResidualCNN().cuda())
    assert policy._meta_bits == 64  # bf16 asked, fp32 written by the Triton kernel
    policy = build_policy("acgc")
    policy.setup(ResidualCNN())
    assert policy._meta_bits == 32


@pytest.mark.parametrize("offload", [False, True])
def test_an_accumulated_calibration_on_gpu_reads_its_last_batch(offload: bool) -> None:
    """tests/test_last_batch.py's reading on a CUDA device; with ``offload_exact`` (the
    batch-size search raised the batch) its two held gradients wait in host memory."""
    from tests.test_last_batch import accumulated_reading

    measured, expected, whole, last = accumulated_reading(torch.device("cuda"), offload)
    assert measured == pytest.approx(expected, rel=1e-3)
    assert measured == pytest.approx(math.sqrt(2) * whole, rel=1e-3)
    held = {t.device.type for t in [*last.own.values(), *(last.before or {}).values()]}
    assert held == ({"cpu"} if offload else {"cuda"})
