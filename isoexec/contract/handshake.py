"""Comparing contracts and checking claims at run time.

- :func:`diff`: human-readable differences between two contracts, one line per differing field.
- :func:`check_handshake`: refuse (raise :class:`ContractMismatch`) when the two sides'
  ``numerical_policy`` digests differ; log deployment differences.
- :func:`check_topology`, :func:`check_engine_settings`: refuse (raise :class:`ClaimViolation`) when
  the running layout or engine configuration contradicts the claims.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping

from .canonical import dumps, encode_value
from .errors import ClaimViolation, ContractError, ContractMismatch, Violation
from .identity import compute_identities, identities_of_path, leaves
from .schema import PARALLEL_DIMS, ExecutionContract, F32

log = logging.getLogger("isoexec.contract")

_SECTIONS = ("model", "cases", "composition", "claims", "deployment")


def render(v: Any) -> str:
    """Short human form of a contract value: JSON-like, floats by ``repr`` (exact, shortest),
    float32 as ``f32(...)``."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, F32):
        return f"f32({v.value!r})"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{json.dumps(k)}: {render(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(render(x) for x in v) + "]"
    return repr(v)


def _section_key(path: str) -> tuple:
    head = path.split(".", 1)[0].split("[", 1)[0]
    return (_SECTIONS.index(head) if head in _SECTIONS else len(_SECTIONS), path)


def diff(a: ExecutionContract, b: ExecutionContract, *, deployment: bool = True) -> list[str]:
    """Differences between two contracts, one line per differing field, e.g.
    ``composition[gdn.core].constants.chunk_size: 64 != 32``. Absent fields print as ``(absent)``.

    Values compare by canonical encoding, so ``0.0`` vs ``-0.0`` and ``1`` vs ``True`` differ.
    Composition entries are matched by label (see :func:`~isoexec.contract.identity.entry_label`).

    Args:
        a, b: the contracts (``a`` on the left of ``!=``).
        deployment: include ``deployment.*`` fields.

    Returns:
        Lines in section order (model, cases, composition, claims, deployment); empty if equal.
    """
    la, lb = leaves(a), leaves(b)
    out = []
    for p in sorted(set(la) | set(lb), key=_section_key):
        if not deployment and identities_of_path(p) == ("deployment",):
            continue
        if p in la and p in lb:
            if dumps(encode_value(la[p])) != dumps(encode_value(lb[p])):
                out.append(f"{p}: {render(la[p])} != {render(lb[p])}")
        elif p in la:
            out.append(f"{p}: {render(la[p])} != (absent)")
        else:
            out.append(f"{p}: (absent) != {render(lb[p])}")
    return out


def check_handshake(local: ExecutionContract, remote: ExecutionContract) -> list[str]:
    """Refuse to run when the two sides' ``numerical_policy`` identities differ.

    Identities are recomputed from content on both sides, so a stale or forged identity cannot pass.
    Deployment differences are logged (logger ``isoexec.contract``, INFO) and returned, never raised.

    Args:
        local: this side's contract.
        remote: the other side's contract.

    Returns:
        The deployment differences (empty if none).

    Raises:
        ContractMismatch: naming both ``numerical_policy`` digests and every differing field.
        ContractError: if a contract's stored identities do not match its own content.
    """
    for side, c in (("local", local), ("remote", remote)):
        if compute_identities(c) != c.identities:
            raise ContractError(f"{side} contract's stored identities do not match its content; rebuild it")
    if local.identities.numerical_policy != remote.identities.numerical_policy:
        raise ContractMismatch(
            local.identities.numerical_policy,
            remote.identities.numerical_policy,
            diff(local, remote, deployment=False),
        )
    dep = [d for d in diff(local, remote) if d.startswith("deployment")]
    if dep:
        log.info(
            "deployment differs (allowed: not bit-relevant): local %s, remote %s\n  %s",
            local.identities.deployment,
            remote.identities.deployment,
            "\n  ".join(dep),
        )
    return dep


def check_topology(
    contract: ExecutionContract, *, tp: int = 1, ep: int = 1, sp: int = 1, pp: int = 1, dp: int = 1, cp: int = 1
) -> None:
    """Check the running parallel layout against ``claims.topology``.

    A claimed dimension allows its pinned degree if pinned, else its domain; an unclaimed dimension
    allows only degree 1.

    Args:
        contract: the contract.
        tp, ep, sp, pp, dp, cp: the running degrees (default 1; ``cp``: context parallelism).

    Raises:
        ClaimViolation: naming every dimension whose degree is not allowed and the allowed degrees.
    """
    degrees = dict(tp=tp, ep=ep, sp=sp, pp=pp, dp=dp, cp=cp)
    v = []
    for dim in PARALLEL_DIMS:
        d = degrees[dim]
        claim = contract.claims.topology.get(dim)
        path = f"claims.topology.{dim}"
        if claim is None:
            if d != 1 or isinstance(d, bool):
                v.append(Violation(path, f"{dim}={d!r} but the contract does not claim {dim}; only {dim}=1 is allowed"))
        elif claim.pinned is not None:
            if d != claim.pinned or isinstance(d, bool):
                v.append(Violation(path, f"{dim}={d!r} is not the pinned degree {claim.pinned}"))
        elif d not in claim.allowed() or isinstance(d, bool):
            v.append(Violation(path, f"{dim}={d!r} is outside the claimed domain {list(claim.allowed())}"))
    if v:
        raise ClaimViolation(v)


def check_engine_settings(
    contract: ExecutionContract, settings: Mapping[str, Any], *, require_all: bool = True
) -> None:
    """Check engine settings against ``claims.engine``.

    Values compare by canonical encoding (type-strict: ``1`` is not ``True``, floats bit for bit).
    Settings the claims do not mention are ignored.

    Args:
        contract: the contract.
        settings: the engine's settings, e.g. ``{"enable_prefix_caching": True, "block_size": 16}``.
        require_all: a claimed setting missing from ``settings`` is a violation (default True).

    Raises:
        ClaimViolation: naming every setting that contradicts the claims, with the required value.
    """
    v = []
    for k, want in contract.claims.engine.items():
        path = f"claims.engine.{k}"
        if k not in settings:
            if require_all:
                v.append(
                    Violation(path, f"the claims require {k}={render(want)} but the engine settings do not set {k}")
                )
            continue
        got = settings[k]
        try:
            same = dumps(encode_value(got)) == dumps(encode_value(want))
        except TypeError:
            same = False
        if not same:
            v.append(
                Violation(
                    path, f"engine setting {k}={render(got)} contradicts the claims, which require {k}={render(want)}"
                )
            )
    if v:
        raise ClaimViolation(v)
