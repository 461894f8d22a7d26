"""Hugging Face causal language models (GPT-2 and Llama architectures) as a
LightningModule: the model families people fine-tune, randomly initialised from their
sizes (nothing is downloaded)."""

from __future__ import annotations

import torch
from torch import nn

from recipes.models.next_token import NextTokenClassifier, check_decoder_sizes

__all__ = ["ARCHITECTURES", "HFCausalLM", "build_causal_lm"]

ARCHITECTURES = ("gpt2", "llama")


def build_causal_lm(
    arch: str,
    vocab_size: int,
    max_seq_len: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    dropout: float = 0.0,
    attn_implementation: str = "sdpa",
) -> nn.Module:
    """A randomly initialised ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` of these sizes.

    ``intermediate_size`` ``None``: 4 x hidden (GPT-2), 8/3 x hidden rounded up to a
    multiple of 64 (Llama). ``num_kv_heads`` (Llama's grouped-query attention) ``None``:
    as many as ``num_heads``; GPT-2 has no such option. The token embedding and the
    output head share their weight, as in GPT-2 and the small Llama models.

    Example:
        >>> net = build_causal_lm("llama", 16, 8, hidden_size=16, num_layers=1, num_heads=2)
        >>> type(net).__name__, net.config.intermediate_size
        ('LlamaForCausalLM', 64)
    """
    if arch == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        if num_kv_heads not in (None, num_heads):
            raise ValueError(
                f"num_kv_heads={num_kv_heads!r}: GPT-2 has one key and value head per "
                "query head; leave it None (or use arch='llama')"
            )
        config = GPT2Config(
            vocab_size=vocab_size,
            n_positions=max_seq_len,
            n_embd=hidden_size,
            n_layer=num_layers,
            n_head=num_heads,
            n_inner=intermediate_size,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            bos_token_id=None,
            eos_token_id=None,
        )
        return GPT2LMHeadModel._from_config(config, attn_implementation=attn_implementation)
    from transformers import LlamaConfig, LlamaForCausalLM

    kv_heads = num_kv_heads or num_heads
    if num_heads % kv_heads:
        raise ValueError(f"num_kv_heads={kv_heads} must divide num_heads={num_heads}")
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or -(-8 * hidden_size // 3 // 64) * 64,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_seq_len,
        attention_dropout=dropout,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation)


class HFCausalLM(NextTokenClassifier):
    """A Hugging Face causal LM (``arch``: ``"gpt2"`` or ``"llama"``) trained to predict
    the next token (:class:`~recipes.models.next_token.NextTokenClassifier`: batches
    ``(inputs, targets)``, the char-LM recipe's data, ``data=pytext``). The forward runs
    without a key/value cache (``use_cache=False``): training reads none, and a cache
    written again when ``torch.utils.checkpoint`` reruns a block would grow.

    Args:
        num_classes: vocabulary size (from the data config).
        max_seq_len: longest context the positions cover (from the data config).
        arch: ``"gpt2"`` (learned positions, LayerNorm, GELU MLP) or ``"llama"`` (rotary
            positions, RMSNorm, SwiGLU MLP, grouped-query attention).
        hidden_size: width of the residual stream.
        num_layers: decoder blocks.
        num_heads: attention heads per block (must divide ``hidden_size``).
        num_kv_heads: key/value heads (Llama only; ``None``: ``num_heads``).
        intermediate_size: MLP width (``None``: the architecture's rule).
        dropout: dropout probability (GPT-2: embeddings, attention, residual; Llama:
            attention only).
        attn_implementation: ``"sdpa"`` (PyTorch's fused attention, Hugging Face's
            default) or ``"eager"`` (explicit softmax).
        **optim: optimizer settings of :class:`~recipes.models.classifier.Classifier`.

    Raises:
        ValueError: an unknown ``arch``, a size below 1, or heads that do not divide.

    Example:
        >>> module = HFCausalLM(num_classes=12, max_seq_len=8, arch="gpt2", hidden_size=16,
        ...                     num_layers=1, num_heads=2)
        >>> module.next_token_logits(torch.randint(0, 12, (3, 8))).shape
        torch.Size([3, 8, 12])
        >>> type(module.net).__name__
        'GPT2LMHeadModel'
    """

    def __init__(
        self,
        num_classes: int,
        max_seq_len: int,
        arch: str = "llama",
        hidden_size: int = 128,
        num_layers: int = 4,
        num_heads: int = 4,
        num_kv_heads: int | None = None,
        intermediate_size: int | None = None,
        dropout: float = 0.0,
        attn_implementation: str = "sdpa",
        **optim: float | str,
    ) -> None:
        super().__init__(num_classes, **optim)  # type: ignore[arg-type]
        self.save_hyperparameters()
        if arch not in ARCHITECTURES:
            raise ValueError(f"arch={arch!r} is unknown; allowed values: {ARCHITECTURES}")
        if attn_implementation not in ("sdpa", "eager"):
            raise ValueError(
                f"attn_implementation={attn_implementation!r}; allowed values: ('sdpa', 'eager')"
            )
        check_decoder_sizes(
            hidden_size, num_heads, dropout, max_seq_len=max_seq_len, num_layers=num_layers,
            num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
        )  # fmt: skip
        self.net = build_causal_lm(
            arch, num_classes, max_seq_len, hidden_size, num_layers, num_heads,
            num_kv_heads, intermediate_size, dropout, attn_implementation,
        )  # fmt: skip

    def next_token_logits(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=inputs, use_cache=False).logits
