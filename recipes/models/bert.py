"""BERT sequence classification (Hugging Face ``transformers``) as a LightningModule."""

from __future__ import annotations

import torch
from transformers import BertConfig, BertForSequenceClassification

from recipes.models.classifier import Classifier

__all__ = ["BertClassifier"]


class BertClassifier(Classifier):
    """``BertForSequenceClassification``, randomly initialised from the sizes given, or
    loaded from local pretrained weights; batches are ``(input_ids, attention_mask, labels)``.

    Args:
        num_classes: number of labels.
        vocab_size: size of the token vocabulary (from the data config).
        max_seq_len: longest sequence the position embeddings cover (from the data config).
        hidden_size: width of the hidden states.
        num_layers: number of encoder layers.
        num_heads: attention heads per layer (must divide ``hidden_size``).
        intermediate_size: width of each layer's feed-forward block.
        dropout: dropout of hidden states and attention probabilities.
        attn_implementation: ``"eager"`` (explicit softmax, saves the attention matrix),
            ``"sdpa"`` (PyTorch's fused attention).
        pretrained: a local directory (or a model id already in the local Hugging Face
            cache) of BERT weights; loaded with ``local_files_only=True``, so it never
            downloads. ``None``: random initialisation from the sizes above, which are
            ignored when weights are loaded.
        **optim: optimizer settings of :class:`~recipes.models.classifier.Classifier`.

    Raises:
        ValueError: ``num_heads`` does not divide ``hidden_size``.
        OSError: ``pretrained`` names weights that are not available locally.

    Example:
        >>> module = BertClassifier(num_classes=2, vocab_size=32, max_seq_len=16,
        ...                         hidden_size=16, num_layers=1, num_heads=2,
        ...                         intermediate_size=32)
        >>> ids = torch.randint(0, 32, (3, 16))
        >>> logits, y = module.logits_and_targets(
        ...     (ids, torch.ones_like(ids), torch.zeros(3, dtype=torch.long)), "train")
        >>> logits.shape
        torch.Size([3, 2])
    """

    def __init__(
        self,
        num_classes: int,
        vocab_size: int,
        max_seq_len: int,
        hidden_size: int = 64,
        num_layers: int = 2,
        num_heads: int = 2,
        intermediate_size: int = 256,
        dropout: float = 0.1,
        attn_implementation: str = "eager",
        pretrained: str | None = None,
        **optim: float | str,
    ) -> None:
        super().__init__(num_classes, **optim)  # type: ignore[arg-type]
        self.save_hyperparameters()
        if pretrained:
            self.net = BertForSequenceClassification.from_pretrained(
                pretrained,
                num_labels=num_classes,
                local_files_only=True,
                attn_implementation=attn_implementation,
            )
            return
        if hidden_size % num_heads:
            raise ValueError(
                f"num_heads={num_heads} must divide hidden_size={hidden_size}; "
                f"pick e.g. num_heads={max(1, hidden_size // 32)}"
            )
        config = BertConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            intermediate_size=intermediate_size,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
            max_position_embeddings=max_seq_len,
            num_labels=num_classes,
            attn_implementation=attn_implementation,
        )
        self.net = BertForSequenceClassification(config)

    def logits_and_targets(
        self, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], stage: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, attention_mask, labels = batch
        out = self.net(input_ids=input_ids, attention_mask=attention_mask)
        return out.logits, labels.long()
