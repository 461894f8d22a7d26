"""``mask_affine``: a ReLU's output remade from its BatchNorm's input and its exact mask;
``mask_positive``: that mask, packed from the ReLU's input in one pass. The compiled CPU
paths against the torch references (bit-identical, NaN in the same places) and the
references against their definitions."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from lightning_acgc.kernels.common import cpu_lib
from lightning_acgc.kernels.mask import (
    mask_affine,
    mask_affine_ref,
    mask_pack,
    mask_positive,
    mask_positive_ref,
    mask_unpack,
)

TINY = torch.finfo(torch.float32).tiny


def _case(shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    channels = shape[1]
    scale = torch.rand(channels, generator=g) * 2
    shift = torch.randn(channels, generator=g)
    view = (1, -1, *(1,) * (len(shape) - 2))
    y = torch.relu(x * scale.view(view) + shift.view(view))
    return x, scale, shift, mask_pack(~(y <= 0))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def _adversarial(x: torch.Tensor) -> torch.Tensor:
    flat = x.view(-1)
    flat[::7] = float("nan")
    flat[3::11] = float("inf")
    flat[5::13] = float("-inf")
    flat[2::17] = 1e-45  # denormals
    flat[4::19] = 3e38  # huge: x·scale overflows to inf
    flat[6::23] = -0.0
    return x


SHAPES = [(4, 8, 12, 12), (3, 5, 7, 3), (5, 6), (2, 3, 13), (2, 3, 16), (1, 1, 40), (2, 4, 1)]


@pytest.mark.skipif(cpu_lib.cpu_library() is None, reason="no C compiler here")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("adversarial", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_compiled_path_is_bit_identical_to_the_reference(shape, adversarial, residual):
    x, scale, shift, bits = _case(shape)
    if adversarial:
        x = _adversarial(x)
    addend = None
    if residual:
        addend = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        addend.view(-1)[1::9] = float("-inf")
    got = mask_affine(x, scale, shift, bits, TINY, addend, backend="cpu")
    ref = mask_affine_ref(x, scale, shift, bits, TINY, addend)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert _same(got, ref)


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_masked_values_are_the_affine_map_at_least_tiny(backend):
    x, scale, shift, _ = _case((3, 4, 5, 6))
    keep = torch.rand(x.shape) < 0.5
    got = mask_affine(x, scale, shift, mask_pack(keep), TINY, backend=backend)
    affine = x * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1)
    assert bool((got[~keep] == 0).all())
    assert torch.equal(got[keep], affine[keep].clamp_min(TINY))
    assert bool((got[keep] > 0).all())  # kept values never rounded to zero


def test_the_residual_branch_is_added_before_the_mask():
    x, scale, shift, _ = _case((2, 3, 4, 5))
    addend = torch.randn(x.shape)
    keep = torch.rand(x.shape) < 0.5
    for backend in ("torch", "auto"):
        got = mask_affine(x, scale, shift, mask_pack(keep), TINY, addend, backend=backend)
        total = x * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1) + addend
        assert torch.equal(got[keep], total[keep].clamp_min(TINY))
        assert bool((got[~keep] == 0).all())


def test_nan_stays_nan_where_kept_and_zero_where_not():
    x = torch.tensor([[float("nan"), float("nan"), float("inf"), -1.0]]).view(1, 4)
    bits = mask_pack(torch.tensor([True, False, True, True]))
    for backend in ("torch", "auto"):
        got = mask_affine(x, torch.ones(4), torch.zeros(4), bits, TINY, backend=backend)
        assert got[0, 0].isnan() and got[0, 1] == 0 and got[0, 2] == float("inf")
        assert got[0, 3] == TINY


def test_empty_non_contiguous_and_float64():
    x, scale, shift, _ = _case((0, 3, 4))
    assert mask_affine(x, scale, shift, mask_pack(x > 0), TINY).shape == (0, 3, 4)
    x, scale, shift, bits = _case((4, 6, 10))
    wide = torch.zeros(4, 6, 20)
    wide[..., ::2] = x  # a strided view: same values
    view = wide[..., ::2]
    assert _same(
        mask_affine(view, scale, shift, bits, TINY), mask_affine_ref(x, scale, shift, bits, TINY)
    )
    x64 = x.double()
    got = mask_affine(x64, scale.double(), shift.double(), bits, torch.finfo(torch.float64).tiny)
    assert got.dtype == torch.float64


def _compiled_variant(tmp_path, flags: list[str], name: str = "acgc_mask_affine_f32"):
    """``mask.c`` built with extra ``flags`` (the AVX2 and the scalar paths, which the
    machine's own build may not take), its function ``name`` via ctypes."""
    import ctypes
    import shutil
    import subprocess

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    source = Path(cpu_lib.__file__).with_name("csrc") / "mask.c"
    target = tmp_path / f"mask{len(flags)}.so"
    cmd = [compiler, *cpu_lib._FLAGS[:1], "-march=native", *flags, *cpu_lib._FLAGS[2:]]
    subprocess.run([*cmd, str(source), "-o", str(target)], check=True, capture_output=True)
    fn = getattr(ctypes.CDLL(str(target)), name)
    fn.restype, fn.argtypes = cpu_lib._SIGNATURES[name]
    return fn


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 flags")
@pytest.mark.parametrize("flags", [["-mno-avx512f"], ["-mno-avx512f", "-mno-avx2"]])
def test_avx2_and_scalar_paths_match_the_reference(tmp_path, flags):
    fn = _compiled_variant(tmp_path, flags)
    for shape in SHAPES:
        x, scale, shift, bits = _case(shape)
        x = _adversarial(x)
        rows = shape[0] * shape[1]
        for add in (None, torch.randn(shape)):  # without and with a residual addend
            out = torch.empty_like(x)
            fn(x.data_ptr(), rows, shape[1], x.numel() // rows, scale.data_ptr(),
               shift.data_ptr(), None if add is None else add.data_ptr(), bits.data_ptr(),
               TINY, out.data_ptr(), 2)  # fmt: skip
            assert _same(out, mask_affine_ref(x, scale, shift, bits, TINY, add)), shape


def _relu_inputs() -> list[torch.Tensor]:
    """Inputs of every length class (under 8, whole bytes, a tail) and adversarial values."""
    g = torch.Generator().manual_seed(1)
    return [
        _adversarial(torch.randn(n, generator=g))
        for n in (0, 1, 7, 8, 9, 64, 1001, 70001)  # 70001: several threads, a tail
    ]


def test_positive_mask_reference_is_its_definition():
    x = torch.tensor([1.0, -1.0, 0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45])
    assert mask_unpack(mask_positive_ref(x), 8).tolist() == [
        True, False, False, False, True, True, False, True,
    ]  # fmt: skip


@pytest.mark.skipif(cpu_lib.cpu_library() is None, reason="no C compiler here")
def test_positive_mask_compiled_path_is_bit_identical():
    for x in _relu_inputs():
        assert torch.equal(mask_positive(x, backend="cpu"), mask_positive_ref(x)), x.numel()
    wide = torch.randn(6, 40)
    view = wide[:, ::2]  # non-contiguous: packed in the view's own (row-major) order
    assert torch.equal(mask_positive(view, backend="cpu"), mask_pack(~(view <= 0)))
    zero_d = torch.tensor(-3.0)
    assert mask_positive(zero_d, backend="cpu").tolist() == [0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_positive_mask_of_other_float_types(dtype):
    x = _adversarial(torch.randn(3, 333)).to(dtype)
    assert torch.equal(mask_positive(x), mask_pack(~(x <= 0)))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 flags")
@pytest.mark.parametrize("flags", [["-mno-avx512f"], ["-mno-avx512f", "-mno-avx2"]])
def test_positive_mask_avx2_and_scalar_paths_match_the_reference(tmp_path, flags):
    fn = _compiled_variant(tmp_path, flags, "acgc_mask_positive_f32")
    for x in _relu_inputs():
        out = torch.empty(-(-x.numel() // 8), dtype=torch.uint8)
        fn(x.data_ptr(), x.numel(), out.data_ptr(), 2)
        assert torch.equal(out, mask_positive_ref(x)), x.numel()
