"""Validation of contracts: every rule is checked and every violation is reported at once.

Entry point: :func:`validate`, which raises one
:class:`~isoexec.contract.errors.ContractValidationError` whose ``violations`` name each field path
and, where there is a fixed set, the allowed values.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from typing import Any, Mapping, Sequence

from .errors import ContractValidationError, Violation
from .identity import entry_label
from .schema import CASES, PARALLEL_DIMS, REGIONS, STATES, ExecutionContract, F32

_HEX64 = re.compile(r"[0-9a-f]{64}")
_EVENT = re.compile(r"[a-z][a-z0-9_]*")


def validate(c: ExecutionContract, *, regions: Sequence[str] = REGIONS, check_identities: bool = True) -> None:
    """Check every rule of a contract and raise once with all violations.

    Rules: cases known, non-empty and unique; model a non-empty mapping; every composition entry
    has a known region (from ``regions``), non-empty unique cases that the contract covers, non-empty
    impl/version/arch/proof and scalar, finite constants; no (region, case) covered twice; topology
    dimensions known, domains of positive ints, non-empty unless pinned, pinned degree positive and
    inside the domain; state events named ``[a-z][a-z0-9_]*`` invalidating known states; tolerances
    finite and >= 0; engine settings scalar and finite; no NaN/inf anywhere; identities (if
    ``check_identities``) 64 lowercase hex chars equal to the digests of the content.

    Args:
        c: the contract.
        regions: known region names (default :data:`~isoexec.contract.schema.REGIONS`).
        check_identities: also check the stored identities against the content.

    Raises:
        ContractValidationError: listing every violation.
    """
    v: list[Violation] = []
    bad = lambda path, msg: v.append(Violation(path, msg))  # noqa: E731

    # model, deployment
    if not isinstance(c.model, Mapping) or not c.model:
        bad("model", "must be a non-empty mapping describing the logical model (e.g. architecture, config digest)")
    else:
        _check_json(c.model, "model", bad)
    if not isinstance(c.deployment, Mapping):
        bad("deployment", "must be a mapping")
    else:
        _check_json(c.deployment, "deployment", bad)

    # cases
    if not c.cases:
        bad("cases", f"must name at least one case (allowed: {list(CASES)})")
    _check_names(c.cases, "cases", CASES, "case", bad)

    # composition
    if not c.composition:
        bad("composition", "must have at least one entry")
    covered: dict[tuple[str, str], list[str]] = defaultdict(list)
    for i, e in enumerate(c.composition):
        p = entry_label(c, i)
        if e.region not in regions:
            bad(f"{p}.region", f"unknown region {e.region!r} (allowed: {list(regions)})")
        if not e.cases:
            bad(f"{p}.cases", f"must name at least one case (allowed: {list(c.cases)})")
        _check_names(e.cases, f"{p}.cases", CASES, "case", bad)
        for case in dict.fromkeys(e.cases):
            if case in CASES and case not in c.cases:
                bad(f"{p}.cases", f"case {case!r} is not among the contract's cases {list(c.cases)}")
            covered[(e.region, case)].append(p)
        for k in ("impl", "version", "arch", "proof"):
            val = getattr(e, k)
            if not isinstance(val, str) or not val.strip():
                what = "discharge reference (gate or test id)" if k == "proof" else k
                bad(f"{p}.{k}", f"must be a non-empty string: the {what}")
        if not isinstance(e.constants, Mapping):
            bad(f"{p}.constants", "must be a mapping name -> int | bool | str | float | F32")
        else:
            for k, x in e.constants.items():
                _check_scalar(x, f"{p}.constants.{k}", bad, key=k)
    for (region, case), where in covered.items():
        if len(where) > 1:
            bad("composition", f"({region}, {case}) is covered by {len(where)} entries: {', '.join(where)}")

    # claims
    cl = c.claims
    for dim, t in cl.topology.items():
        p = f"claims.topology.{dim}"
        if dim not in PARALLEL_DIMS:
            bad(p, f"unknown parallel dimension {dim!r} (allowed: {list(PARALLEL_DIMS)})")
        if not t.domain and t.pinned is None:
            bad(f"{p}.domain", "empty domain and no pinned degree (give e.g. domain=(1, 2, 4, 8) or pinned=1)")
        for x in t.domain:
            if not _is_int(x) or x <= 0:
                bad(f"{p}.domain", f"{x!r} is not a positive integer degree")
        if len(set(map(repr, t.domain))) != len(t.domain):
            bad(f"{p}.domain", f"duplicate degrees in {list(t.domain)}")
        if t.pinned is not None:
            if not _is_int(t.pinned) or t.pinned <= 0:
                bad(f"{p}.pinned", f"{t.pinned!r} is not a positive integer degree")
            elif t.domain and t.pinned not in t.domain:
                bad(f"{p}.pinned", f"pinned degree {t.pinned} is outside the domain {sorted(t.domain)}")
    for ev, states in cl.state.items():
        p = f"claims.state.{ev}"
        if not isinstance(ev, str) or not _EVENT.fullmatch(ev):
            bad(p, "event name must match [a-z][a-z0-9_]* (e.g. weight_sync, preemption)")
        if not states:
            bad(p, f"must invalidate at least one state (allowed: {list(STATES)})")
        _check_names(states, p, STATES, "state", bad)
    for k, x in cl.tolerances.items():
        p = f"claims.tolerances.{k}"
        if not isinstance(k, str) or not k:
            bad(p, "tolerance name must be a non-empty string")
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            bad(p, f"must be a float >= 0, got {type(x).__name__} {x!r}")
        elif not math.isfinite(x):
            bad(p, f"must be finite, got {x!r}")
        elif x < 0:
            bad(p, f"must be >= 0, got {x!r}")
    for k, x in cl.engine.items():
        _check_scalar(x, f"claims.engine.{k}", bad, key=k)

    # identities
    if check_identities:
        from .identity import compute_identities

        try:
            now = compute_identities(c)
        except TypeError:
            now = None  # already reported above as a bad type
        for name in ("semantic", "numerical_policy", "deployment"):
            stored = getattr(c.identities, name)
            if not isinstance(stored, str) or not _HEX64.fullmatch(stored):
                bad(f"identities.{name}", f"must be 64 lowercase hex chars (SHA-256), got {stored!r}")
            elif now is not None and getattr(now, name) != stored:
                bad(f"identities.{name}", f"stored {stored} != content digest {getattr(now, name)}")

    if v:
        raise ContractValidationError(v)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_names(names: Sequence[Any], path: str, allowed: Sequence[str], what: str, bad) -> None:
    seen: list = []
    for n in names:
        if n not in allowed:
            bad(path, f"unknown {what} {n!r} (allowed: {list(allowed)})")
        if n in seen:
            bad(path, f"duplicate {what} {n!r}")
        seen.append(n)


def _check_scalar(x: Any, path: str, bad, key: Any = None) -> None:
    if key is not None and (not isinstance(key, str) or not key):
        bad(path, "name must be a non-empty string")
    if isinstance(x, float):
        if not math.isfinite(x):
            bad(path, f"must be finite, got {x!r} (NaN/inf cannot be pinned)")
    elif isinstance(x, F32):
        if not math.isfinite(x.value):
            bad(path, f"must be finite, got F32({x.value!r}) (NaN/inf cannot be pinned)")
    elif not isinstance(x, (bool, int, str)):
        bad(path, f"must be int | bool | str | float | F32, got {type(x).__name__} {x!r}")


def _check_json(x: Any, path: str, bad) -> None:
    if isinstance(x, Mapping):
        if set(x) in ({"f64"}, {"f32"}):
            bad(path, "a mapping with the single key 'f64' or 'f32' is reserved for float bit patterns")
        for k, y in x.items():
            if not isinstance(k, str) or not k:
                bad(f"{path}.{k}", "key must be a non-empty string")
            _check_json(y, f"{path}.{k}", bad)
    elif isinstance(x, (list, tuple)):
        for i, y in enumerate(x):
            _check_json(y, f"{path}[{i}]", bad)
    elif x is not None:
        _check_scalar(x, path, bad)
