"""The GPU scripts' own launches, run under the interpreter: ``scripts/gpu_kernel_ab.py``
launches the quant kernels by hand, so its arguments must follow the kernels'."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from lightning_acgc.kernels.quant import quant_decode_ref

pytest.importorskip("triton")

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_kernel_ab.py"


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gpu_kernel_ab", _SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("dtype", "bits"), [(torch.float32, 2), (torch.bfloat16, 4)])
def test_kernel_ab_launches_decode_what_they_encode(dtype: torch.dtype, bits: int) -> None:
    ab = _script()
    x = torch.randn(3 * ab.GROUP + 40).relu().to(dtype)
    encode, decode, written = ab._launchers(ab.current, x, bits, None)
    encode()
    decode()
    payload = {key: written[key] for key in ("codes", "lo", "scale")}
    payload["exc_idx"] = torch.empty(0, dtype=torch.int64)
    payload["exc_val"] = torch.empty(0, dtype=dtype)
    want = quant_decode_ref(payload, bits, ab.GROUP, x.numel(), dtype)
    torch.testing.assert_close(written["out"], want, atol=0, rtol=0)
    assert bool(((want.float() - x.float()).abs() <= payload["scale"].abs().max() + 1e-6).all())
