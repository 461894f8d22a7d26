"""A small GPT-style causal transformer for character-level language modelling."""

from __future__ import annotations

import math

import torch
from torch import nn

from recipes.models.next_token import NextTokenClassifier, check_decoder_sizes

__all__ = ["CausalSelfAttention", "CharGPT", "CharLM"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention written out (eager): the scores' softmax and the
    two batched matmuls run as separate ops, so autograd saves the attention matrix and
    the compression hooks see it.

    Example:
        >>> attn = CausalSelfAttention(hidden_size=8, num_heads=2, max_seq_len=4)
        >>> attn(torch.randn(3, 4, 8)).shape
        torch.Size([3, 4, 8])
    """

    def __init__(self, hidden_size: int, num_heads: int, max_seq_len: int, dropout: float = 0.0):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)
        self.dropout = nn.Dropout(dropout)
        mask = torch.ones(max_seq_len, max_seq_len, dtype=torch.bool).tril()
        self.register_buffer("causal", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.num_heads
        q, k, v = self.qkv(x).view(b, t, 3, h, c // h).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // h))
        scores = scores.masked_fill(~self.causal[:t, :t], float("-inf"))
        att = self.dropout(scores.softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.dropout(self.proj(y))


class _Block(nn.Module):
    """Pre-norm transformer block: attention and a GELU MLP, each with a residual."""

    def __init__(self, hidden_size: int, num_heads: int, max_seq_len: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden_size)
        self.attn = CausalSelfAttention(hidden_size, num_heads, max_seq_len, dropout)
        self.ln2 = nn.LayerNorm(hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_size, 4 * hidden_size),
            nn.GELU(),
            nn.Linear(4 * hidden_size, hidden_size),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """Token and learned position embeddings, pre-norm blocks, a final LayerNorm and a
    linear head: next-token logits ``(batch, seq, vocab_size)`` of ids ``(batch, seq)``.

    Example:
        >>> net = CharGPT(vocab_size=10, max_seq_len=6, hidden_size=8, num_layers=1, num_heads=2)
        >>> net(torch.randint(0, 10, (2, 6))).shape
        torch.Size([2, 6, 10])
    """

    def __init__(
        self,
        vocab_size: int,
        max_seq_len: int,
        hidden_size: int,
        num_layers: int,
        num_heads: int,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, hidden_size)
        self.pos = nn.Embedding(max_seq_len, hidden_size)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(
            *(_Block(hidden_size, num_heads, max_seq_len, dropout) for _ in range(num_layers))
        )
        self.ln_f = nn.LayerNorm(hidden_size)
        self.head = nn.Linear(hidden_size, vocab_size)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * num_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.tok(ids) + self.pos(pos))
        return self.head(self.ln_f(self.blocks(x)))


class CharLM(NextTokenClassifier):
    """A :class:`CharGPT` trained to predict the next character
    (:class:`~recipes.models.next_token.NextTokenClassifier`: batches ``(inputs,
    targets)``, ``val/loss`` in nats per character).

    Args:
        num_classes: vocabulary size (from the data config).
        max_seq_len: longest context the position embeddings cover (from the data config).
        hidden_size: width of the residual stream.
        num_layers: transformer blocks.
        num_heads: attention heads per block (must divide ``hidden_size``).
        dropout: dropout of embeddings, attention probabilities and block outputs.
        **optim: optimizer settings of :class:`~recipes.models.classifier.Classifier`.

    Raises:
        ValueError: ``num_heads`` does not divide ``hidden_size``, or a size below 1.

    Example:
        >>> module = CharLM(num_classes=12, max_seq_len=8, hidden_size=16, num_layers=1,
        ...                 num_heads=2)
        >>> x = torch.randint(0, 12, (3, 8))
        >>> logits, y = module.logits_and_targets((x, x.roll(-1, 1)), "train")
        >>> tuple(logits.shape), tuple(y.shape)
        ((24, 12), (24,))
    """

    def __init__(
        self,
        num_classes: int,
        max_seq_len: int,
        hidden_size: int = 128,
        num_layers: int = 4,
        num_heads: int = 4,
        dropout: float = 0.0,
        **optim: float | str,
    ) -> None:
        super().__init__(num_classes, **optim)  # type: ignore[arg-type]
        self.save_hyperparameters()
        check_decoder_sizes(
            hidden_size, num_heads, dropout, max_seq_len=max_seq_len, num_layers=num_layers
        )
        self.net = CharGPT(num_classes, max_seq_len, hidden_size, num_layers, num_heads, dropout)

    def next_token_logits(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)
