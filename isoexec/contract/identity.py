"""Digests of contracts: the three identities and per-field digests.

Identities (SHA-256 hex of canonical JSON, each preimage tagged with the schema and its kind):

- ``semantic`` = H({model, cases}): same logical model and cases;
- ``numerical_policy`` = H({semantic, composition, claims}): every bit-relevant choice, the
  handshake key;
- ``deployment`` = H({deployment}): settings proven not to change bits; logged, never required to
  match.

:func:`leaves` flattens a contract into ``path -> value`` (e.g.
``composition[gdn.core].constants.chunk_size -> 64``); it drives both :func:`~isoexec.contract.diff`
and the per-field digests stored beside the identities in saved files, so that a changed file can
be traced to the field that was edited.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any, Mapping

from .canonical import canonical_list, claims_to_obj, composition_to_obj, dumps, encode_value, entry_to_obj
from .schema import SCHEMA, ExecutionContract, Identities

IDENTITY_NAMES = ("semantic", "numerical_policy", "deployment")
FIELD_DIGEST_HEX = 16
"""Length of per-field digests (hex chars). They only locate edits; integrity comes from identities."""


def sha256_hex(obj: Any) -> str:
    """SHA-256 hex of the canonical JSON of an already-encoded object."""
    return hashlib.sha256(dumps(obj)).hexdigest()


def compute_identities(c: ExecutionContract) -> Identities:
    """Compute the three identities of a contract from its content (ignores ``c.identities``).

    Raises:
        TypeError: if some value cannot be encoded.
    """
    semantic = sha256_hex(
        {"schema": SCHEMA, "kind": "semantic", "model": encode_value(c.model), "cases": canonical_list(c.cases)}
    )
    policy = sha256_hex(
        {
            "schema": SCHEMA,
            "kind": "numerical_policy",
            "semantic": semantic,
            "composition": composition_to_obj(c.composition),
            "claims": claims_to_obj(c.claims),
        }
    )
    deployment = sha256_hex({"schema": SCHEMA, "kind": "deployment", "deployment": encode_value(c.deployment)})
    return Identities(semantic=semantic, numerical_policy=policy, deployment=deployment)


def identities_of_path(path: str) -> tuple[str, ...]:
    """Which identities a leaf path feeds, e.g. ``model.x`` -> (semantic, numerical_policy)."""
    if path == "cases" or path.startswith("model"):
        return ("semantic", "numerical_policy")
    if path.startswith("deployment"):
        return ("deployment",)
    return ("numerical_policy",)


def entry_label(c: ExecutionContract, index: int) -> str:
    """Stable label of composition entry ``index``: ``composition[REGION]`` when the region has one
    entry, else ``composition[REGION@case1+case2]`` (cases sorted)."""
    e = c.composition[index]
    counts = Counter(x.region for x in c.composition)
    if counts[e.region] == 1:
        return f"composition[{e.region}]"
    return f"composition[{e.region}@{'+'.join(sorted(map(str, e.cases)))}]"


def _flatten(prefix: str, v: Any, out: dict) -> None:
    if isinstance(v, Mapping) and v:
        for k, x in v.items():
            _flatten(f"{prefix}.{k}", x, out)
    else:
        out[prefix] = v


def leaves(c: ExecutionContract) -> dict[str, Any]:
    """Flatten a contract's content (not its identities) into ``path -> Python value``.

    Paths: ``model.K...``, ``cases``, ``composition[LABEL].{cases,impl,version,arch,proof}``,
    ``composition[LABEL].constants.K``, ``claims.topology.DIM.{domain,pinned}``,
    ``claims.state.EVENT``, ``claims.tolerances.K``, ``claims.engine.K``, ``deployment.K...``.
    Unordered lists (cases, domains, states) are sorted. A label used twice gets ``#2``, ``#3``.
    """
    out: dict[str, Any] = {}
    _flatten("model", c.model, out)
    out["cases"] = tuple(sorted(c.cases))
    seen: Counter = Counter()
    order = sorted(range(len(c.composition)), key=lambda i: dumps(entry_to_obj(c.composition[i])))
    for i in order:
        e = c.composition[i]
        label = entry_label(c, i)
        seen[label] += 1
        if seen[label] > 1:
            label = f"{label}#{seen[label]}"
        out[f"{label}.cases"] = tuple(sorted(e.cases))
        for k in ("impl", "version", "arch", "proof"):
            out[f"{label}.{k}"] = getattr(e, k)
        _flatten(f"{label}.constants", e.constants, out)
    cl = c.claims
    for dim, t in cl.topology.items():
        out[f"claims.topology.{dim}.domain"] = tuple(sorted(t.domain, key=_int_first))
        out[f"claims.topology.{dim}.pinned"] = t.pinned
    for ev, states in cl.state.items():
        out[f"claims.state.{ev}"] = tuple(sorted(states, key=str))
    for k, v in cl.tolerances.items():
        out[f"claims.tolerances.{k}"] = float(v) if isinstance(v, int) and not isinstance(v, bool) else v
    _flatten("claims.engine", cl.engine, out)
    _flatten("deployment", c.deployment, out)
    return out


def _int_first(x: Any) -> tuple:
    return (0, x, "") if isinstance(x, int) and not isinstance(x, bool) else (1, 0, repr(x))


def leaf_digest(path: str, value: Any) -> str:
    """Short digest of one field (path and canonical value), :data:`FIELD_DIGEST_HEX` hex chars."""
    return sha256_hex([path, encode_value(value)])[:FIELD_DIGEST_HEX]


def field_digests(c: ExecutionContract) -> dict[str, str]:
    """Per-field digests ``path -> short digest`` of every leaf (see :func:`leaves`)."""
    return {p: leaf_digest(p, v) for p, v in leaves(c).items()}


def changed_fields(c: ExecutionContract, stored: Mapping[str, str]) -> list[str]:
    """Fields whose digest differs from ``stored`` (edited, added or removed), sorted.

    Each item is ``PATH`` (edited), ``PATH (added)`` or ``PATH (removed)``.
    """
    now = field_digests(c)
    out = []
    for p in sorted(set(now) | set(stored)):
        if p not in stored:
            out.append(f"{p} (added)")
        elif p not in now:
            out.append(f"{p} (removed)")
        elif now[p] != stored[p]:
            out.append(p)
    return out
