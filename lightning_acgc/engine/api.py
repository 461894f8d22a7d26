"""``compress_activations``: the engine as a context manager for plain PyTorch."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from lightning_acgc.config import CompressionConfig
from lightning_acgc.engine.compressor import ActivationCompressor
from lightning_acgc.engine.meter import CompressionStats

__all__ = ["compress_activations"]


@contextlib.contextmanager
def compress_activations(
    config: CompressionConfig | None = None,
    *,
    model: nn.Module | None = None,
    policy: Any = None,
    keep_packed: bool = False,
    memory_budget: int | None = None,
    **kwargs: Any,
) -> Iterator[CompressionStats]:
    """Compress every activation autograd saves inside the ``with`` block.

    Args:
        config: a :class:`CompressionConfig`; or give its fields and the codec's options
            as keyword arguments (``codec="quant", bits=2``).
        model: names sites by the model's module names (otherwise by type and order).
        policy: an object choosing a codec per site; default: ``config``'s codec everywhere.
        keep_packed: keep the packed tensors in ``stats`` for inspection (tests).
        memory_budget: bytes of live saved activations allowed (see
            :class:`ActivationCompressor`).
        **kwargs: :class:`CompressionConfig` fields and codec options.

    Yields:
        :class:`CompressionStats` filled as tensors are saved.

    Raises:
        ValueError: bad codec name or option, raised before anything runs.

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
    if config is None:
        config = CompressionConfig.from_kwargs(**kwargs)
    elif kwargs:
        raise ValueError(f"give either config or keyword options, not both (got {sorted(kwargs)})")
    if policy is None:
        from lightning_acgc.codecs.spec import CodecSpec
        from lightning_acgc.policies.fixed import FixedPolicy

        policy = FixedPolicy(CodecSpec(config.codec, config.codec_options, config.backend))
    engine = ActivationCompressor(
        policy,
        model=model,
        min_numel=config.min_numel,
        seed=config.seed,
        compress_masks=config.compress_masks,
        strict=config.strict,
        keep_packed=keep_packed,
        memory_budget=memory_budget,
    )
    engine.install()
    engine.new_step(0)
    if keep_packed:
        engine.stats.packed = engine.packed_log  # type: ignore[attr-defined]
    try:
        with engine.scope() as stats:
            yield stats
    finally:
        engine.remove()
