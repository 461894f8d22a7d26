"""The compression configs build ``lightning_acgc.ActivationCompression`` directly; every
key is one of its arguments or an option the config's policy declares, written once."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import yaml

from lightning_acgc import ActivationCompression
from lightning_acgc.policies import policy_class, policy_option_names
from recipes import config_schema
from recipes.config_schema import CONFIG_DIR

_POLICIES = sorted(p.stem for p in (CONFIG_DIR / "compression").glob("*.yaml") if p.stem != "none")
_ADAPTER = CONFIG_DIR / "compression" / "adapter" / "default.yaml"


def _named_arguments() -> set[str]:
    params = inspect.signature(ActivationCompression.__init__).parameters.values()
    return {p.name for p in params if p.kind is not p.VAR_KEYWORD} - {"self"}


def _keys(path) -> set[str]:
    data = yaml.safe_load(path.read_text())
    return set(data) - {"defaults"}


def _schema(policy: str) -> type:
    name = {"acgc": "ACGC", "gact": "GACT", "comet": "COMET"}.get(policy, policy.title())
    return getattr(config_schema, f"{name}CompressionSchema")


def test_adapter_config_targets_the_callback_and_names_its_arguments() -> None:
    data = yaml.safe_load(_ADAPTER.read_text())
    assert data["_target_"] == "lightning_acgc.ActivationCompression"
    fields = {f.name for f in dataclasses.fields(config_schema.CompressionSchema)}
    assert fields - {"_target_"} == _named_arguments()
    assert _keys(_ADAPTER) - {"_target_"} == _named_arguments() - {"policy"}


@pytest.mark.parametrize("policy", _POLICIES)
def test_policy_config_keys_are_declared_options_written_once(policy: str) -> None:
    path = CONFIG_DIR / "compression" / f"{policy}.yaml"
    keys = _keys(path)
    assert yaml.safe_load(path.read_text())["policy"] == policy
    assert not keys & _keys(_ADAPTER), "an option written in two files"
    allowed = set(policy_option_names(policy_class(policy))) | {"policy"}
    if policy_class(policy).takes_codec_options:
        from lightning_acgc.codecs import available_codecs, codec_option_names

        allowed |= {o for c in available_codecs() for o in codec_option_names(c)}
    assert keys <= allowed, sorted(keys - allowed)
    base = {f.name for f in dataclasses.fields(config_schema.CompressionSchema)}
    own = {f.name for f in dataclasses.fields(_schema(policy))} - base
    assert own == keys - {"policy"}, "the schema and the YAML list different options"
