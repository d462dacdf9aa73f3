"""The policies, in the one list every command and driver takes them from, and the specs
that name them on the command line (``name`` or ``name:key=value,...``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import Field
from typing import Any

from smetric.core.errors import ConfigError
from smetric.core.policies.base import RoutingPolicy, balances_load
from smetric.core.policies.cache_aware import CacheAware
from smetric.core.policies.least_load import LeastLoad
from smetric.core.policies.linear import Linear
from smetric.core.policies.lmetric import LMetric
from smetric.core.policies.prefill_tokens import PrefillTokens
from smetric.core.policies.round_robin import RoundRobin
from smetric.core.policies.session_hash import SessionHash
from smetric.core.policies.smetric import SMetric
from smetric.core.policies.smetric_cost import SMetricCost
from smetric.core.settings import Meta, default_of, settings_of

POLICIES: dict[str, type[RoutingPolicy]] = {
    cls.name: cls
    for cls in (
        SMetric,
        Linear,
        LMetric,
        LeastLoad,
        PrefillTokens,
        RoundRobin,
        SessionHash,
        CacheAware,
        SMetricCost,
    )
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)

# What ``smetric serve``, ``demo`` and ``knee`` use unless told otherwise: the policy that
# earned it in the evaluation (docs/results/knees.md).
DEFAULT_POLICY = "smetric_cost"


def policy_class(name: str) -> type[RoutingPolicy]:
    try:
        return POLICIES[name]
    except KeyError:
        raise ConfigError(
            f"unknown policy {name!r}; valid policies: {', '.join(POLICY_NAMES)}"
        ) from None


def base_name(spec: str) -> str:
    """The policy a spec names: ``smetric`` of ``smetric:overload=3``."""
    return spec.partition(":")[0].strip()


def is_ours(spec: str) -> bool:
    """Whether a spec's policy is one this project proposes (at any setting) rather than
    a baseline it is compared with."""
    return policy_class(base_name(spec)).ours


def parameters(name: str) -> dict[str, tuple[Field[Any], Meta]]:
    """A policy's parameters, each with its field (type, default) and declaration."""
    return {f.name: (f, meta) for f, meta in settings_of(policy_class(name))}


def policy_params(name: str) -> dict[str, float]:
    """The tunable parameters of a policy and their defaults (empty when it has none)."""
    return {key: default_of(f) for key, (f, _) in parameters(name).items()}


def hardware_params(name: str) -> tuple[str, ...]:
    """The parameters of a policy that depend on the hardware it routes for."""
    return tuple(key for key, (_, meta) in parameters(name).items() if meta.source == "hardware")


def resolve_policy(
    spec: str, rates: Mapping[str, float] | None = None
) -> tuple[str, dict[str, float]]:
    """A spec's policy name and the value of each of its parameters.

    A parameter takes the spec's value, else, where it is declared derived from the
    hardware, the hardware rate it names from ``rates`` (what a driver that knows the
    hardware, the simulator, derives: ``model.calibrate``), else its default.
    """
    name, params = spec_params(spec)
    declared = parameters(name)
    for key, default in policy_params(name).items():
        if key in params:
            continue
        rate = declared[key][1].rate
        if rates is not None and rate is not None and rate in rates:
            params[key] = float(rates[rate])
        else:
            params[key] = default
    return name, params


def spec_params(spec: str) -> tuple[str, dict[str, float]]:
    """A spec's policy name and the parameters it gives, checked against the policy's."""
    name = base_name(spec)
    rest = spec.strip().partition(":")[2]
    defaults = policy_params(name)
    params: dict[str, float] = {}
    for item in rest.split(",") if rest.strip() else ():
        key, eq, text = (part.strip() for part in item.partition("="))
        if not eq:
            raise ConfigError(f"policy {spec!r}: expected key=value, got {item.strip()!r}")
        if key not in defaults:
            valid = ", ".join(defaults) or "none"
            raise ConfigError(f"policy {name!r} has no parameter {key!r}; valid: {valid}")
        if key in params:
            raise ConfigError(f"policy {spec!r}: parameter {key!r} given twice")
        try:
            params[key] = float(text)
        except ValueError:
            raise ConfigError(f"policy {spec!r}: {key}={text!r} is not a number") from None
    return name, params


def split_policies(text: str) -> tuple[str, ...]:
    """'smetric,linear:lam=0.95' -> two specs; a ',' inside name:k=v,k=v stays with it."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if "=" in part and ":" not in part and out:
            out[-1] += "," + part
        else:
            out.append(part)
    return tuple(out)


def make_policy(
    spec: str, rates: Mapping[str, float] | None = None, load: str = "inflight_requests"
) -> RoutingPolicy:
    """A fresh policy from ``name`` or ``name:key=value,key=value``.

    For example ``smetric:overload=1.5,hit_ratio=0.3`` or ``linear:lam=0.95``; ``rates``
    fill the policy's hardware-derived parameters the spec leaves out
    (``resolve_policy``). ``load`` is the view's count the policy balances where it
    balances one (``LOAD_SIGNALS``): the driver's to say, since it knows what it serves.
    """
    name, params = resolve_policy(spec, rates)
    cls = policy_class(name)
    values: dict[str, Any] = dict(params)
    if balances_load(cls):
        values["load"] = load
    return cls(**values)
