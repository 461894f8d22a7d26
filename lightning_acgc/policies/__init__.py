"""Policies: who decides each site's codec settings."""

from lightning_acgc.policies.acgc import ACGCPolicy
from lightning_acgc.policies.base import Policy, Reduce
from lightning_acgc.policies.comet import CometPolicy
from lightning_acgc.policies.division import DivisionPolicy
from lightning_acgc.policies.fixed import FixedPolicy
from lightning_acgc.policies.gact import GACTPolicy
from lightning_acgc.policies.off import OffPolicy
from lightning_acgc.policies.registry import (
    accepted_codecs,
    available_policies,
    build_policy,
    policy_class,
    policy_option_names,
    register_policy,
)

register_policy("acgc", ACGCPolicy)
register_policy("comet", CometPolicy)
register_policy("division", DivisionPolicy)
register_policy("fixed", FixedPolicy)
register_policy("gact", GACTPolicy)
register_policy("off", OffPolicy)

__all__ = [
    "ACGCPolicy",
    "CometPolicy",
    "DivisionPolicy",
    "FixedPolicy",
    "GACTPolicy",
    "OffPolicy",
    "Policy",
    "Reduce",
    "accepted_codecs",
    "available_policies",
    "build_policy",
    "policy_class",
    "policy_option_names",
    "register_policy",
]
