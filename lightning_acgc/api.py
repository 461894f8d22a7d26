"""``compress_activations``: the engine with one codec everywhere, as a context manager
for plain PyTorch (above the engine: it picks the ``fixed`` policy)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from torch import nn

from lightning_acgc.codecs.spec import CodecSpec
from lightning_acgc.engine.compressor import ActivationCompressor
from lightning_acgc.engine.meter import CompressionStats
from lightning_acgc.engine.settings import EngineSettings
from lightning_acgc.policies.base import Policy
from lightning_acgc.policies.fixed import FixedPolicy

__all__ = ["compress_activations"]


_ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineSettings))


@contextlib.contextmanager
def compress_activations(
    codec: CodecSpec | None = None,
    *,
    model: nn.Module | None = None,
    policy: Policy | None = None,
    settings: EngineSettings | None = None,
    keep_packed: bool = False,
    memory_budget: int | None = None,
    inputs: Any = None,
    **kwargs: Any,
) -> Iterator[CompressionStats]:
    """Compress every activation autograd saves inside the ``with`` block.

    Args:
        codec: the codec used everywhere, a :class:`~lightning_acgc.codecs.CodecSpec`;
            or give ``codec=<name>``, ``backend`` and the codec's options as keyword
            arguments (``codec="quant", bits=2``).
        model: names sites by the model's module names (otherwise by type and order).
        policy: chooses a codec per site instead; default: ``codec`` everywhere.
        settings: the engine's :class:`~lightning_acgc.engine.EngineSettings`; or give
            its fields as keyword arguments (``min_numel=0``).
        keep_packed: keep the packed tensors in ``stats`` for inspection (tests).
        memory_budget: bytes of live saved activations allowed (see
            :class:`~lightning_acgc.engine.ActivationCompressor`).
        inputs: the batch (tensors nested in lists, dicts, ...), which you hold until
            backward is done: saved as it is, counted as neither saved nor kept (a packed
            copy of a tensor alive anyway would only add memory).
        **kwargs: :class:`EngineSettings` fields, ``codec``, ``backend`` and codec options.

    Yields:
        :class:`CompressionStats` filled as tensors are saved.

    Raises:
        ValueError: bad codec name or option, bad engine setting, raised before
            anything runs.

    Example:
        >>> import torch
        >>> from lightning_acgc import compress_activations
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
        >>> with compress_activations(codec="quant", bits=2) as stats:
        ...     model(torch.randn(128, 64)).sum().backward()
        >>> stats.ratio > 8
        True
    """
    engine_kwargs = {k: kwargs.pop(k) for k in _ENGINE_FIELDS if k in kwargs}
    if settings is None:
        settings = EngineSettings(**engine_kwargs)
    elif engine_kwargs:
        raise ValueError(f"give either settings or {sorted(engine_kwargs)}, not both")
    if isinstance(codec, str):
        kwargs["codec"] = codec
        codec = None
    if codec is None:
        name, backend = kwargs.pop("codec", "quant"), kwargs.pop("backend", "auto")
        codec = CodecSpec(name, kwargs, backend)
    elif kwargs:
        raise ValueError(f"give either a CodecSpec or codec options, not both ({sorted(kwargs)})")
    engine = ActivationCompressor(
        policy if policy is not None else FixedPolicy(codec),
        model=model,
        settings=settings,
        keep_packed=keep_packed,
        memory_budget=memory_budget,
    )
    engine.install()
    engine.new_step(0)
    engine.inputs.hold(inputs)
    if keep_packed:
        engine.stats.packed = engine.packed_log  # type: ignore[attr-defined]
    try:
        with engine.scope() as stats:
            yield stats
    finally:
        engine.remove()
