"""``quant`` kernels: per-group stochastic quantization, routed to Triton (CUDA), the
compiled CPU path, or the pure-torch reference (see
:func:`lightning_acgc.kernels.common.dispatch.route`). The format is described in
:mod:`lightning_acgc.kernels.quant.reference`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_acgc.kernels.common.dispatch import route
from lightning_acgc.kernels.common.groups import group_view
from lightning_acgc.kernels.quant.cpu import quant_decode_cpu, quant_encode_cpu
from lightning_acgc.kernels.quant.reference import (
    META_FORMATS,
    hash_uniform,
    quant_decode_ref,
    quant_encode_ref,
    uniform_noise,
    without_inf_steps,
)

__all__ = [
    "META_FORMATS",
    "group_view",
    "hash_uniform",
    "quant_decode",
    "quant_decode_ref",
    "quant_encode",
    "quant_encode_deferred",
    "quant_encode_ref",
    "stored_meta",
    "uniform_noise",
]

_TRITON = "lightning_acgc.kernels.quant.triton"


def stored_meta(meta: str, device_type: str, backend: str = "auto") -> str:
    """The metadata format ``quant_encode`` writes when asked for ``meta``: the Triton
    kernel writes float32 only, so with ``backend="auto"`` a CUDA tensor asked for
    ``"bf16"`` gets ``"fp32"`` (32 bits a group more, and steps exact instead of rounded
    up to bfloat16, so never a larger error) rather than the torch reference, which runs
    many times slower there.

    Example:
        >>> stored_meta("bf16", "cuda"), stored_meta("bf16", "cpu")
        ('fp32', 'bf16')
    """
    return "fp32" if device_type == "cuda" and backend == "auto" else meta


def quant_encode(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    seed: int,
    backend: str = "auto",
    meta: str = "fp32",
    reject_inf_steps: bool = False,
) -> dict[str, torch.Tensor] | None:
    """Encode a non-empty floating tensor, its metadata in :func:`stored_meta`'s format
    (``backend="torch"`` keeps ``meta`` as asked on every device).

    ``reject_inf_steps``: return ``None`` instead of a payload holding a step beyond the
    metadata's float format (stored as inf); the Triton and compiled CPU paths check only
    their rare reference fallback, the one place such a step comes from (no host sync).

    Example:
        >>> x = torch.arange(8.0)
        >>> y = quant_decode(quant_encode(x, 8, 8, seed=0), 8, 8, 8, torch.float32)
        >>> y[0].item(), bool((y - x).abs().max() < 0.03)
        (0.0, True)
    """
    fn, meta = _encoder(x, backend, meta, "quant_encode_triton")
    if fn is quant_encode_cpu or fn is quant_encode_ref:
        return _encode_checked(fn, x, bits, group_size, seed, meta, reject_inf_steps)
    return fn(x.contiguous(), bits, group_size, seed, reject_inf_steps=reject_inf_steps)


def quant_encode_deferred(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    seed: int,
    backend: str = "auto",
    meta: str = "fp32",
) -> tuple[dict[str, torch.Tensor] | None, torch.Tensor | None]:
    """:func:`quant_encode` with ``reject_inf_steps=True``, without waiting for the
    device: ``(payload, status)``. On the Triton path ``status`` is a one-element int32
    device tensor and the payload is valid where it is 0 (else encode again with
    :func:`quant_encode`); on the other paths, which check at once, ``status`` is
    ``None`` and the payload ``None`` where a step overflows.

    Example:
        >>> payload, status = quant_encode_deferred(torch.ones(64), 2, 64, 0)
        >>> sorted(payload), status
        (['codes', 'exc_idx', 'exc_val', 'lo', 'scale'], None)
    """
    fn, meta = _encoder(x, backend, meta, "quant_encode_triton_unchecked")
    if fn is quant_encode_cpu or fn is quant_encode_ref:
        return _encode_checked(fn, x, bits, group_size, seed, meta, True), None
    return fn(x.contiguous(), bits, group_size, seed)


def _encoder(
    x: torch.Tensor, backend: str, meta: str, triton: str
) -> tuple[Callable[..., Any], str]:
    """The encoder that takes ``x`` (``triton``: the Triton launcher's name) and the
    metadata format it writes."""
    if meta != "fp32" and backend == "triton":
        raise ValueError(
            f"meta={meta!r} needs backend 'auto', 'torch' or 'cpu': the Triton "
            "kernel writes fp32 metadata only"
        )
    meta = stored_meta(meta, x.device.type, backend)
    if meta != "fp32" and x.device.type != "cpu":
        backend = "torch"
    return route(x, backend, quant_encode_ref, f"{_TRITON}:{triton}", quant_encode_cpu), meta


def _encode_checked(
    fn: Callable[..., Any],
    x: torch.Tensor,
    bits: int,
    group_size: int,
    seed: int,
    meta: str,
    reject_inf_steps: bool,
) -> dict[str, torch.Tensor] | None:
    """The compiled CPU path or the reference (both check at once)."""
    if fn is quant_encode_cpu:
        return fn(x, bits, group_size, seed, meta=meta, reject_inf_steps=reject_inf_steps)
    payload = fn(x, bits, group_size, seed, meta=meta)
    return without_inf_steps(payload) if reject_inf_steps else payload


def quant_decode(
    payload: dict[str, torch.Tensor],
    bits: int,
    group_size: int,
    numel: int,
    dtype: torch.dtype,
    backend: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Flat tensor of ``numel`` decoded values in ``dtype`` (any path's payload).

    ``out``: a contiguous flat tensor of ``numel`` values in ``dtype`` to decode into (the
    Triton kernel and the compiled CPU path write it directly; the reference copies its
    result); returned.

    Example:
        >>> x = torch.arange(16.0)
        >>> out = torch.zeros(32)
        >>> _ = quant_decode(quant_encode(x, 8, 8, 0), 8, 8, 16, torch.float32, out=out[8:24])
        >>> out[8].item(), out[7].item(), bool((out[8:24] - x).abs().max() < 0.05)
        (0.0, 0.0, True)
    """
    if payload["lo"].dtype != torch.float32 and payload["lo"].device.type != "cpu":
        backend = "torch"
    fn = route(
        payload["lo"], backend, quant_decode_ref, f"{_TRITON}:quant_decode_triton", quant_decode_cpu
    )
    if out is not None and out.dtype != dtype:
        raise ValueError(f"out has dtype {out.dtype}, the decode gives {dtype}")
    if out is not None and fn is quant_decode_cpu and dtype == torch.float32:
        return fn(payload, bits, group_size, numel, dtype, out=out)
    triton_path = fn is not quant_decode_ref and fn is not quant_decode_cpu
    if out is not None and triton_path and out.is_contiguous():
        return fn(payload, bits, group_size, numel, dtype, out=out)
    flat = fn(payload, bits, group_size, numel, dtype)
    return flat if out is None else out.copy_(flat)
