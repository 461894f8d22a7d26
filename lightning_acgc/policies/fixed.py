"""``fixed``: one codec setting for every site (baseline and ablations).

With ``quant``, the inputs of BatchNorm are quantized per channel-normalized value
(:class:`~lightning_acgc.codecs.channels.ChannelNormalized`, 8 bytes per channel): the
same bits and groups, but a group's step no longer follows its widest channel. Without
it fixed 2-bit training of the ResNet recipe diverges (see that module).

Normalization statistics (BatchNorm's per-channel mean and 1/σ, LayerNorm's per row) are
kept as they are by the engine, whatever the policy
(:func:`~lightning_acgc.engine.sites.is_norm_statistic`): a 1/(N·H·W) share of a
BatchNorm's bytes, and its backward multiplies every value by 1/σ. Those of 64 channels or
more are large enough to be packed together with other small tensors, and at 2 bits they
made the ResNet recipe's 10-epoch fit overflow to NaN near step 75 on seeds 1, 2 and 3
(the first to grow were the gradients of layer 3's convs, its BatchNorms the first with
64 channels); kept, those seeds train to 0.99-1.00 at 14.16x instead of 14.18x.
"""

from __future__ import annotations

import torch

from lightning_acgc.codecs.base import Codec
from lightning_acgc.codecs.channels import ChannelNormalized
from lightning_acgc.codecs.spec import CodecSpec
from lightning_acgc.engine.sites import SiteInfo
from lightning_acgc.policies.base import Policy
from lightning_acgc.policies.error_model import is_batch_norm_input

__all__ = ["FixedPolicy"]


class FixedPolicy(Policy):
    """The same codec everywhere.

    Args:
        config: the codec and its options (default: ``quant`` with its defaults).

    Example:
        >>> from lightning_acgc.codecs import CodecSpec
        >>> policy = FixedPolicy(CodecSpec("quant", {"bits": 4}))
        >>> policy.describe(policy.codec)
        'bits=4 group_size=256 meta=fp32'
    """

    name = "fixed"
    codecs = None  # any registered codec
    takes_codec_options = True

    def __init__(self, config: CodecSpec | None = None) -> None:
        self.config = config or CodecSpec()
        self.codec = self.config.build()
        # the identity codec is the control: the engine compresses nothing, masks and
        # integer tensors included
        self.control = self.codec.name == "identity"
        quant = self.codec.name == "quant"
        self.norm_input_codec = ChannelNormalized(self.codec) if quant else self.codec

    def codec_for(self, site: SiteInfo, x: torch.Tensor) -> Codec | None:
        if is_batch_norm_input(site.module_type, x):
            return self.norm_input_codec
        return self.codec
