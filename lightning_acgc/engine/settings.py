"""The engine's own settings, apart from any codec choice."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineSettings"]


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class EngineSettings:
    """What the engine does around the codecs, whatever the policy chooses.

    Args:
        min_numel: tensors with fewer elements are not encoded alone: floating ones of at
            least ``coalesce_min_numel`` elements are encoded together with the other
            small tensors of the step that share their codec (see
            :mod:`lightning_acgc.engine.coalesce`), the others are kept as they are.
        coalesce_min_numel: the smallest floating tensors encoded together; ``None``
            keeps every tensor under ``min_numel`` as it is.
        seed: base of the per-step, per-site seeds kept with the packed data (codecs
            never draw from the global RNG).
        compress_masks: bool tensors (dropout masks) go to the lossless 1-bit ``mask``
            codec, and so do floating tensors without autograd history holding two
            values (the float mask ``F.dropout`` draws on CPU).
        strict: re-raise codec errors instead of keeping the tensor uncompressed.
        compress_loss: also compress the floating tensors saved outside every module's
            forward (the loss's: cross-entropy's log-probabilities, computed in
            ``training_step`` after the model ran) with the policy's codecs. By default
            the engine stores float32 ones as float16 (``half``; kept where a value is
            beyond its range, and those of other dtypes kept as they are): their error
            enters the output gradient δ = p − y itself, so every layer's gradient, and
            grows relative to δ as the model gets confident. Fixed 2-bit quantization of
            them took a 3-epoch run of the ResNet recipe to chance accuracy (0.10 against
            0.94 with them kept, same run otherwise). float16 rounds log p by at most
            2**-11 of itself, so p by a factor within 1 ± 2**-11·|log p|: δ = p − 1 of a
            confident class (|log p| ≈ 1 − p) by about 2**-11 of itself.
        low_peak: a tensor remade at unpack from others (a ReLU's output from its
            BatchNorm's input, a LayerNorm's output from its input) decodes them without
            keeping them decoded until their own unpacks, which decode them again: a
            lower step peak for more decoding (``benchmarks/memory.py`` and
            ``speed.py``'s ``acgc_low_peak``). Off by default: the values are the same
            either way.
        remake_products: where a policy derives outputs (``acgc``), a Linear's or a
            convolution's output that the next op saves (attention's q, k and v, a
            GELU's input, a BatchNorm's input) is stored as nothing and its product made
            again at unpack from the product's own saved input: the product runs once
            more in backward, as checkpointing pays it. ``False`` stores those outputs
            through the policy's codecs instead: less time, more memory (the elementwise
            outputs, a LayerNorm's, an activation's, are still remade: they cost little).

    Raises:
        ValueError: a negative or non-int ``min_numel`` or ``coalesce_min_numel``, a
            non-int ``seed``.

    Example:
        >>> EngineSettings(min_numel=0).min_numel
        0
        >>> EngineSettings(min_numel=-1)
        Traceback (most recent call last):
        ...
        ValueError: min_numel=-1 must be an int >= 0
    """

    min_numel: int = 1024
    seed: int = 0
    compress_masks: bool = True
    strict: bool = False
    coalesce_min_numel: int | None = 64
    compress_loss: bool = False
    low_peak: bool = False
    remake_products: bool = True

    def __post_init__(self) -> None:
        if not _count(self.min_numel):
            raise ValueError(f"min_numel={self.min_numel!r} must be an int >= 0")
        if self.coalesce_min_numel is not None and not _count(self.coalesce_min_numel):
            raise ValueError(
                f"coalesce_min_numel={self.coalesce_min_numel!r} must be an int >= 0 or None"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an int")
