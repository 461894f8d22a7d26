"""Policies: who decides each site's codec settings."""

from lightning_acgc.policies.base import Policy, Reduce
from lightning_acgc.policies.fixed import FixedPolicy
from lightning_acgc.policies.off import OffPolicy
from lightning_acgc.policies.registry import available_policies, build_policy, register_policy

register_policy("fixed", FixedPolicy)
register_policy("off", OffPolicy)

__all__ = [
    "FixedPolicy",
    "OffPolicy",
    "Policy",
    "Reduce",
    "available_policies",
    "build_policy",
    "register_policy",
]
