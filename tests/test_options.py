"""Flat keyword options are routed by what each registered policy and codec declares."""

from __future__ import annotations

import inspect

import pytest

from lightning_acgc import ActivationCompression
from lightning_acgc.codecs import available_codecs, codec_option_names
from lightning_acgc.policies import (
    accepted_codecs,
    available_policies,
    build_policy,
    policy_class,
    policy_option_names,
)

# A value each declared option accepts, where its default would not do (a codec's option
# must be valid for that codec; a policy's option is given its constructor default).
_CODEC_VALUES = {"bits": 4, "group_size": 128, "error_bound": 0.01, "relative": True}


def _policy_default(name: str, option: str):
    return inspect.signature(policy_class(name).__init__).parameters[option].default


def test_declared_policy_options_match_the_constructor() -> None:
    """A policy's ``options`` declaration names exactly its constructor's options."""
    for name in available_policies():
        cls = policy_class(name)
        params = {
            n
            for n, p in inspect.signature(cls.__init__).parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        }
        assert set(cls.options) == params - {"self", "config"}, name
        assert ("config" in params) == (cls.codecs != ()), name


@pytest.mark.parametrize("name", ["acgc", "comet", "division", "fixed", "gact", "off"])
def test_every_declared_option_is_accepted_by_its_owner_and_rejected_elsewhere(name: str) -> None:
    assert name in available_policies()
    cls = policy_class(name)
    for option in cls.options:
        policy = build_policy(name, **{option: _policy_default(name, option)})
        assert policy.name == name
        for other in available_policies():
            if option in policy_option_names(policy_class(other)):
                continue
            with pytest.raises(ValueError, match=rf"policy '{other}'.*\['{option}'\].*options are"):
                build_policy(other, **{option: _policy_default(name, option)})
    for codec in accepted_codecs(cls):
        assert build_policy(name, codec=codec).config.codec == codec
        for option in codec_option_names(codec):
            if option in policy_option_names(cls, codec):
                value = _CODEC_VALUES.get(option)
                kwargs = {option: value} if value is not None else {}
                assert build_policy(name, codec=codec, **kwargs).config.codec == codec
            else:
                with pytest.raises(ValueError, match=rf"policy '{name}'.*\['{option}'\]"):
                    build_policy(name, codec=codec, **{option: _CODEC_VALUES.get(option, 1)})
    for codec in set(available_codecs()) - set(accepted_codecs(cls)):
        with pytest.raises(ValueError, match=rf"policy '{name}'.*codec"):
            build_policy(name, codec=codec)


def test_options_listed_in_the_message_are_exactly_the_accepted_ones() -> None:
    with pytest.raises(ValueError) as info:
        build_policy("gact", colour=1)
    listed = str(info.value).split("its options are ")[1]
    assert listed == str(policy_option_names(policy_class("gact")))
    assert "calibrate_every" in listed and "bits" in listed


def test_acgc_rejects_a_codec_it_does_not_use() -> None:
    """Was accepted and then shown as in force, though acgc builds its own codecs."""
    with pytest.raises(ValueError, match=r"policy 'acgc' chooses its own codec settings.*codec="):
        ActivationCompression(policy="acgc", codec="division")
    with pytest.raises(ValueError, match=r"policy 'acgc' does not take \['bits'\]; its options"):
        ActivationCompression(policy="acgc", bits=2)


def test_default_policy_names_itself_for_an_option_it_lacks() -> None:
    """Was: "codec 'bounded' does not take ['residual_bits']", a codec never chosen."""
    with pytest.raises(ValueError) as info:
        ActivationCompression(residual_bits=4)
    message = str(info.value)
    assert message.startswith("policy 'acgc' does not take ['residual_bits']; its options are")
    assert "gradient_error" in message and "bounded" not in message


def test_off_takes_no_options() -> None:
    with pytest.raises(ValueError, match=r"policy 'off' does not take \['bits'\]"):
        ActivationCompression(policy="off", bits=2)
    with pytest.raises(ValueError, match=r"policy 'off' does not take \['codec'\]"):
        ActivationCompression(policy="off", codec="quant")
    assert not ActivationCompression(policy="off").enabled


def test_fixed_names_policy_and_codec_for_a_foreign_codec_option() -> None:
    with pytest.raises(ValueError, match=r"policy 'fixed' with codec 'quant' does not take"):
        ActivationCompression(codec="quant", error_bound=0.1)
    cb = ActivationCompression(codec="bounded", error_bound=0.1, relative=True)
    assert cb.describe() == "fixed codec=bounded error_bound=0.1 relative=True"


def test_a_policy_may_accept_several_codecs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accepted set is one declaration on the class; its first entry is the default."""
    cls = policy_class("comet")
    monkeypatch.setattr(cls, "codecs", ("bounded", "quant"))
    assert build_policy("comet").config.codec == "bounded"
    assert build_policy("comet", codec="quant").config.codec == "quant"
    with pytest.raises(ValueError, match=r"takes codec in \['bounded', 'quant'\]"):
        build_policy("comet", codec="division")


def test_engine_settings_do_not_travel_through_the_policy() -> None:
    from lightning_acgc import CodecSpec, EngineSettings

    cb = ActivationCompression(policy="acgc", min_numel=7, strict=True, compress_masks=False)
    assert cb.settings == EngineSettings(min_numel=7, seed=0, compress_masks=False, strict=True)
    assert cb.policy.config == CodecSpec("quant")
    with pytest.raises(ValueError, match="min_numel=-1"):
        ActivationCompression(policy="off", min_numel=-1)
