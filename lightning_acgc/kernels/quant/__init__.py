"""``quant`` kernels: per-group stochastic quantization, routed to Triton (CUDA), the
compiled CPU path, or the pure-torch reference (see
:func:`lightning_acgc.kernels.common.dispatch.route`). The format is described in
:mod:`lightning_acgc.kernels.quant.reference`."""

from __future__ import annotations

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
    if meta != "fp32" and backend == "triton":
        raise ValueError(
            f"meta={meta!r} needs backend 'auto', 'torch' or 'cpu': the Triton "
            "kernel writes fp32 metadata only"
        )
    meta = stored_meta(meta, x.device.type, backend)
    if meta != "fp32" and x.device.type != "cpu":
        backend = "torch"
    fn = route(x, backend, quant_encode_ref, f"{_TRITON}:quant_encode_triton", quant_encode_cpu)
    if fn is quant_encode_cpu:
        return fn(x, bits, group_size, seed, meta=meta, reject_inf_steps=reject_inf_steps)
    if fn is quant_encode_ref:
        payload = fn(x, bits, group_size, seed, meta=meta)
        if reject_inf_steps and not bool(torch.isfinite(payload["scale"]).all()):
            return None
        return payload
    return fn(x.contiguous(), bits, group_size, seed, reject_inf_steps=reject_inf_steps)


def quant_encode_deferred(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    seed: int,
    backend: str = "auto",
    meta: str = "fp32",
) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
    """The Triton encode without waiting for the device: ``(payload, status)``, the
    payload valid where ``status`` (a one-element int32 device tensor) is 0, else to be
    encoded again with :func:`quant_encode`; ``None`` where ``x`` takes another path
    (encode it with :func:`quant_encode`).

    Example:
        >>> quant_encode_deferred(torch.ones(64), 2, 64, 0, backend="torch") is None
        True
    """
    if stored_meta(meta, x.device.type, backend) != "fp32":
        return None
    fn = route(
        x, backend, quant_encode_ref, f"{_TRITON}:quant_encode_triton_unchecked", quant_encode_cpu
    )
    if fn is quant_encode_ref or fn is quant_encode_cpu:
        return None
    return fn(x.contiguous(), bits, group_size, seed)


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
