"""What the language-model recipes share: next-token prediction as classification, and
the checks of a decoder's sizes."""

from __future__ import annotations

import torch

from recipes.models.classifier import Classifier

__all__ = ["NextTokenClassifier", "check_decoder_sizes"]


class NextTokenClassifier(Classifier):
    """A language model trained to predict the next token; batches are
    ``(inputs, targets)`` of shape ``(batch, seq)``, and subclasses give
    :meth:`next_token_logits`. Every position is one classification over the vocabulary,
    so :class:`Classifier`'s metrics apply as they are: ``val/loss`` is the cross-entropy
    in nats per token and ``val/acc`` the share of next tokens predicted exactly.
    """

    def next_token_logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, seq, vocabulary)`` of token ids ``(batch, seq)``."""
        raise NotImplementedError

    def logits_and_targets(
        self, batch: tuple[torch.Tensor, torch.Tensor], stage: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = batch
        logits = self.next_token_logits(inputs)
        return logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)


def check_decoder_sizes(
    hidden_size: int, num_heads: int, dropout: float, **sizes: int | None
) -> None:
    """Raise ``ValueError`` for a size below 1 (``None`` passes: a default), heads that do
    not divide ``hidden_size``, or a dropout outside [0, 1).

    Example:
        >>> check_decoder_sizes(64, 4, 0.1, num_layers=2)
        >>> check_decoder_sizes(64, 3, 0.0)
        Traceback (most recent call last):
        ...
        ValueError: num_heads=3 must divide hidden_size=64; pick e.g. num_heads=2
    """
    for name, value in {"hidden_size": hidden_size, "num_heads": num_heads, **sizes}.items():
        if value is not None and value < 1:
            raise ValueError(f"{name}={value!r} must be >= 1")
    if hidden_size % num_heads:
        raise ValueError(
            f"num_heads={num_heads} must divide hidden_size={hidden_size}; "
            f"pick e.g. num_heads={max(1, hidden_size // 32)}"
        )
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout={dropout!r} must be in [0, 1)")
