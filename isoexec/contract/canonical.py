"""Canonical JSON encoding of contracts (the only module that turns contracts into bytes and back).

Rules: keys sorted, no whitespace, UTF-8 (non-ASCII kept as is), no raw floats. Floats are carried
as exact bit patterns, lowercase hex of the IEEE-754 word:

- ``float`` (float64): ``{"f64": "0x3eb0c6f7a0b5ed8d"}`` (that is ``1e-06``);
- :class:`~isoexec.contract.schema.F32` (float32): ``{"f32": "0x358637bd"}``.

Lists whose order carries no meaning are sorted (cases, composition entries, topology domains,
invalidated states), so digests do not depend on declaration order. Decoding refuses unknown or
missing fields, duplicate keys, raw JSON numbers with a fraction or exponent, ``NaN``/``Infinity``
literals and malformed bit patterns, collecting every problem into one
:class:`~isoexec.contract.errors.ContractDecodeError`. ``decode(encode(c))`` re-encodes to the
same bytes.
"""

from __future__ import annotations

import json
import re
import struct
from types import MappingProxyType
from typing import Any, Mapping

from .errors import ContractDecodeError, Violation
from .schema import SCHEMA, Claims, CompositionEntry, ExecutionContract, F32, Identities, TopologyClaim

_F64 = re.compile(r"0x[0-9a-f]{16}")
_F32 = re.compile(r"0x[0-9a-f]{8}")


# ----------------------------------------------------------------------------- values


def f64_hex(x: float) -> str:
    """Bit pattern of a float64 as ``0x`` + 16 lowercase hex digits."""
    return "0x%016x" % struct.unpack("<Q", struct.pack("<d", x))[0]


def f32_hex(x: F32) -> str:
    """Bit pattern of an :class:`F32` as ``0x`` + 8 lowercase hex digits."""
    return "0x%08x" % x.bits


def encode_value(v: Any) -> Any:
    """Turn a JSON-like Python value into its canonical JSON-ready form.

    Args:
        v: ``None``, ``bool``, ``int``, ``str``, ``float``, :class:`F32`, or mappings (str keys) and
            sequences of these.

    Returns:
        The same structure with floats replaced by ``{"f64": ...}`` / ``{"f32": ...}``.

    Raises:
        TypeError: on any other type, a non-str key, or a mapping that would read back as a float.
    """
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return {"f64": f64_hex(v)}
    if isinstance(v, F32):
        return {"f32": f32_hex(v)}
    if isinstance(v, Mapping):
        if set(v) in ({"f64"}, {"f32"}):
            raise TypeError(f"mapping with the single key {next(iter(v))!r} is reserved for floats")
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise TypeError(f"mapping key {k!r} is not a str")
            out[k] = encode_value(x)
        return out
    if isinstance(v, (list, tuple)):
        return [encode_value(x) for x in v]
    raise TypeError(f"cannot encode {type(v).__name__} value {v!r} in a contract")


def dumps(obj: Any) -> bytes:
    """Canonical JSON bytes of an already-encoded object (sorted keys, no whitespace, UTF-8).

    Raises:
        ValueError: if ``obj`` contains a raw float (encode it with :func:`encode_value` first).
    """
    _refuse_raw_floats(obj)
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _refuse_raw_floats(obj: Any) -> None:
    if isinstance(obj, float):
        raise ValueError(f"raw float {obj!r} in canonical JSON; encode it as a bit pattern")
    if isinstance(obj, dict):
        for x in obj.values():
            _refuse_raw_floats(x)
    elif isinstance(obj, list):
        for x in obj:
            _refuse_raw_floats(x)


def _sort_key(v: Any) -> tuple:
    if isinstance(v, int) and not isinstance(v, bool):
        return (0, v, "")
    return (1, 0, json.dumps(encode_value(v), sort_keys=True))


def canonical_list(values: Any) -> list:
    """Encode a sequence whose order carries no meaning: encoded and sorted (duplicates kept)."""
    return [encode_value(x) for x in sorted(values, key=_sort_key)]


# ----------------------------------------------------------------------------- contract -> obj


def entry_to_obj(e: CompositionEntry) -> dict:
    """Canonical JSON-ready form of one composition entry."""
    return {
        "region": e.region,
        "cases": canonical_list(e.cases),
        "impl": e.impl,
        "version": e.version,
        "arch": e.arch,
        "constants": encode_value(e.constants),
        "proof": e.proof,
    }


def composition_to_obj(entries: Any) -> list:
    """Canonical form of a composition: entries encoded and sorted by (region, cases, content)."""
    objs = [entry_to_obj(e) for e in entries]
    return sorted(objs, key=lambda o: (o["region"], o["cases"], dumps(o)))


def claims_to_obj(c: Claims) -> dict:
    """Canonical JSON-ready form of :class:`Claims` (tolerances always as float64)."""

    def tol(v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

    return {
        "topology": {
            dim: {"domain": canonical_list(t.domain), "pinned": encode_value(t.pinned)} for dim, t in c.topology.items()
        },
        "state": {event: canonical_list(states) for event, states in c.state.items()},
        "tolerances": {k: encode_value(tol(v)) for k, v in c.tolerances.items()},
        "engine": encode_value(c.engine),
    }


def identities_to_obj(i: Identities) -> dict:
    """JSON form of :class:`Identities`."""
    return {"semantic": i.semantic, "numerical_policy": i.numerical_policy, "deployment": i.deployment}


def to_obj(c: ExecutionContract) -> dict:
    """Canonical JSON-ready document of a contract (``schema``, parts, ``identities``).

    Raises:
        TypeError: if some value cannot be encoded.
    """
    return {
        "schema": SCHEMA,
        "model": encode_value(c.model),
        "cases": canonical_list(c.cases),
        "composition": composition_to_obj(c.composition),
        "claims": claims_to_obj(c.claims),
        "deployment": encode_value(c.deployment),
        "identities": identities_to_obj(c.identities),
    }


def encode(c: ExecutionContract) -> bytes:
    """Canonical bytes of a contract (see module docstring).

    Raises:
        TypeError: if some value cannot be encoded.
    """
    return dumps(to_obj(c))


# ----------------------------------------------------------------------------- obj -> contract


class _RawNumber(str):
    """A JSON number with fraction/exponent, or NaN/Infinity, kept as text so decode can refuse it."""


def _pairs(pairs: list) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def parse_json(text: str | bytes, source: str = "<contract>") -> Any:
    """Parse JSON text strictly (duplicate keys refused; raw floats kept as markers for decode).

    Raises:
        ContractDecodeError: naming ``source`` and the line/column of the first syntax error.
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ContractDecodeError([Violation("<bytes>", f"not UTF-8 at byte {e.start}")], source) from e
    try:
        return json.loads(text, object_pairs_hook=_pairs, parse_float=_RawNumber, parse_constant=_RawNumber)
    except json.JSONDecodeError as e:
        where = f"line {e.lineno} column {e.colno} (char {e.pos})"
        raise ContractDecodeError([Violation(where, f"malformed JSON: {e.msg}")], source) from e
    except ValueError as e:  # duplicate key
        raise ContractDecodeError([Violation("<json>", str(e))], source) from e


class _Reader:
    """Collects decode problems instead of stopping at the first."""

    def __init__(self) -> None:
        self.problems: list[Violation] = []

    def bad(self, path: str, msg: str) -> None:
        self.problems.append(Violation(path, msg))

    def fields(self, obj: Any, path: str, names: tuple[str, ...]) -> dict | None:
        if not isinstance(obj, dict):
            self.bad(path, f"expected an object with fields {list(names)}, got {_kind(obj)}")
            return None
        for k in sorted(set(obj) - set(names)):
            self.bad(f"{path}.{k}" if path else k, f"unknown field (allowed: {list(names)})")
        for k in names:
            if k not in obj:
                self.bad(f"{path}.{k}" if path else k, "missing field")
        return obj

    def typed(self, obj: Any, path: str, typ: type | tuple, what: str) -> Any:
        ok = isinstance(obj, typ) and not (isinstance(obj, bool) and bool not in _tuple(typ))
        if not ok or isinstance(obj, _RawNumber):
            self.bad(path, f"expected {what}, got {_kind(obj)}")
            return None
        return obj

    def value(self, obj: Any, path: str) -> Any:
        if isinstance(obj, _RawNumber):
            self.bad(path, f'raw float {obj} not allowed; write it as a bit pattern {{"f64": "0x..."}}')
            return None
        if isinstance(obj, dict):
            if set(obj) == {"f64"} or set(obj) == {"f32"}:
                ((key, bits),) = obj.items()
                pat = _F64 if key == "f64" else _F32
                if not isinstance(bits, str) or not pat.fullmatch(bits):
                    n = 16 if key == "f64" else 8
                    self.bad(path, f"bad {key} bit pattern {bits!r}; expected '0x' + {n} lowercase hex digits")
                    return None
                if key == "f64":
                    return struct.unpack("<d", struct.pack("<Q", int(bits, 16)))[0]
                return F32(struct.unpack("<f", struct.pack("<I", int(bits, 16)))[0])
            return MappingProxyType({k: self.value(v, f"{path}.{k}") for k, v in obj.items()})
        if isinstance(obj, list):
            return tuple(self.value(v, f"{path}[{i}]") for i, v in enumerate(obj))
        return obj

    def mapping(self, obj: Any, path: str) -> dict:
        if not isinstance(obj, dict):
            self.bad(path, f"expected an object, got {_kind(obj)}")
            return {}
        return {k: self.value(v, f"{path}.{k}") for k, v in obj.items()}

    def str_list(self, obj: Any, path: str) -> tuple:
        if not isinstance(obj, list):
            self.bad(path, f"expected a list of strings, got {_kind(obj)}")
            return ()
        return tuple(x for i, x in enumerate(obj) if self.typed(x, f"{path}[{i}]", str, "a string") is not None)


def _tuple(t: type | tuple) -> tuple:
    return t if isinstance(t, tuple) else (t,)


def _kind(x: Any) -> str:
    if isinstance(x, _RawNumber):
        return f"raw float {x}"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer"}.get(
        type(x), "null" if x is None else type(x).__name__
    )


_TOP = ("schema", "model", "cases", "composition", "claims", "deployment", "identities")
_ENTRY = ("region", "cases", "impl", "version", "arch", "constants", "proof")
_CLAIMS = ("topology", "state", "tolerances", "engine")
_TOPO = ("domain", "pinned")
_IDS = ("semantic", "numerical_policy", "deployment")


def from_obj(obj: Any, source: str | None = None) -> ExecutionContract:
    """Decode a parsed document into an :class:`ExecutionContract` (structure only; rules are
    checked by :func:`~isoexec.contract.validate.validate`).

    Args:
        obj: output of :func:`parse_json`.
        source: name used in error messages (e.g. the file path).

    Raises:
        ContractDecodeError: listing every unknown/missing field, wrong type, raw float and bad
            bit pattern.
    """
    if not isinstance(obj, dict) or not set(obj) & set(_TOP):
        # some other JSON document: one line, not a missing-field error per contract field
        has = (f"it has {', '.join(map(str, list(obj)[:8])) or 'no field'}" if isinstance(obj, dict)
               else f"it is {_kind(obj)}, not an object")
        raise ContractDecodeError([Violation("<json>", f"not an execution contract (fields {', '.join(_TOP)}): {has}")],
                                  source)
    r = _Reader()
    top = r.fields(obj, "", _TOP) or {}
    if "schema" in top and top["schema"] != SCHEMA:
        r.bad("schema", f"unsupported schema {top['schema']!r} (expected {SCHEMA!r})")
    model = r.mapping(top.get("model", {}), "model")
    deployment = r.mapping(top.get("deployment", {}), "deployment")
    cases = r.str_list(top.get("cases", []), "cases")

    entries = []
    comp = top.get("composition", [])
    if not isinstance(comp, list):
        r.bad("composition", f"expected a list, got {_kind(comp)}")
        comp = []
    for i, e in enumerate(comp):
        p = f"composition[{i}]"
        f = r.fields(e, p, _ENTRY)
        if f is None:
            continue
        s = {
            k: r.typed(f.get(k, ""), f"{p}.{k}", str, "a string")
            for k in ("region", "impl", "version", "arch", "proof")
        }
        entries.append(
            CompositionEntry(
                region=s["region"] or "",
                cases=r.str_list(f.get("cases", []), f"{p}.cases"),
                impl=s["impl"] or "",
                version=s["version"] or "",
                arch=s["arch"] or "",
                constants=r.mapping(f.get("constants", {}), f"{p}.constants"),
                proof=s["proof"] or "",
            )
        )

    cl = r.fields(top.get("claims", {}), "claims", _CLAIMS) or {}
    topology = {}
    topo = cl.get("topology", {})
    if not isinstance(topo, dict):
        r.bad("claims.topology", f"expected an object, got {_kind(topo)}")
        topo = {}
    for dim, t in topo.items():
        p = f"claims.topology.{dim}"
        f = r.fields(t, p, _TOPO)
        if f is None:
            continue
        dom = f.get("domain", [])
        if not isinstance(dom, list):
            r.bad(f"{p}.domain", f"expected a list of integers, got {_kind(dom)}")
            dom = []
        dom = tuple(x for i, x in enumerate(dom) if r.typed(x, f"{p}.domain[{i}]", int, "an integer") is not None)
        pinned = f.get("pinned")
        if pinned is not None:
            pinned = r.typed(pinned, f"{p}.pinned", int, "an integer or null")
        topology[dim] = TopologyClaim(domain=dom, pinned=pinned)
    state_obj = cl.get("state", {})
    if not isinstance(state_obj, dict):
        r.bad("claims.state", f"expected an object, got {_kind(state_obj)}")
        state_obj = {}
    state = {ev: r.str_list(v, f"claims.state.{ev}") for ev, v in state_obj.items()}
    claims = Claims(
        topology=topology,
        state=state,
        tolerances=r.mapping(cl.get("tolerances", {}), "claims.tolerances"),
        engine=r.mapping(cl.get("engine", {}), "claims.engine"),
    )

    ids = r.fields(top.get("identities", {}), "identities", _IDS) or {}
    idv = {k: r.typed(ids.get(k, ""), f"identities.{k}", str, "a hex string") or "" for k in _IDS}

    if r.problems:
        raise ContractDecodeError(r.problems, source)
    return ExecutionContract(model, cases, tuple(entries), claims, deployment, Identities(**idv))


def decode(data: str | bytes, source: str = "<contract>") -> ExecutionContract:
    """Parse and decode canonical (or any strictly valid) contract JSON.

    Raises:
        ContractDecodeError: malformed JSON (with line/column), unknown/missing fields, raw floats.
    """
    return from_obj(parse_json(data, source), source)
