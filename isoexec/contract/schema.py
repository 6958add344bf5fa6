"""Data types of the execution contract (docs/design.md, The execution contract). Pure data: no I/O, no hashing.

An :class:`ExecutionContract` has four parts:

- ``cases``: the execution cases it covers (subset of :data:`CASES`);
- ``composition``: one :class:`CompositionEntry` per (region, set of cases): implementation id,
  version, arch, pinned constants and the proof (gate or test id) that discharges it;
- ``claims``: :class:`Claims`, the conditions under which the composition holds (topology, state
  invalidation, tolerances, engine settings);
- ``identities``: :class:`Identities`, three SHA-256 digests (``semantic``, ``numerical_policy``,
  ``deployment``) computed by :mod:`isoexec.contract.identity`.

Constants are ``int | bool | str | float | F32``. A plain Python ``float`` is a float64 constant;
wrap a value in :class:`F32` to pin it as float32. Both are carried as exact bit patterns in the
canonical encoding (:mod:`isoexec.contract.canonical`). Mappings given to the constructors are copied
into read-only mappings and sequences into tuples, so a built contract cannot change under its
digests.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Sequence, Union

SCHEMA = "isoexec.contract/1"
"""Schema tag carried in every encoded contract and in every digest preimage."""

CASES: tuple[str, ...] = ("trainer_fwd", "trainer_score", "engine_prefill", "engine_decode")
"""Execution cases where a token's logprob is computed (docs/design.md, Terms)."""

REGIONS: tuple[str, ...] = (
    "embed",
    "norm.rms",
    "attn.qkv_proj",
    "attn.rope",
    "attn.core",
    "attn.gate",
    "attn.out_proj",
    "gdn.in_proj",
    "gdn.conv1d",
    "gdn.gating",
    "gdn.l2norm",
    "gdn.core",
    "gdn.norm",
    "gdn.out_proj",
    "moe.router",
    "moe.experts",
    "moe.combine",
    "mlp.shared_expert",
    "lm_head",
    "logprob",
)
"""Known regions (docs/design.md, Terms). To use another region, pass ``regions=REGIONS + ("x.y",)`` to
``ExecutionContract.build`` / ``validate`` / ``load``; the extension is explicit at every call."""

PARALLEL_DIMS: tuple[str, ...] = ("tp", "ep", "sp", "pp", "dp", "cp")
"""Parallel dimensions a topology claim may name. An unclaimed dimension is pinned to degree 1."""

STATES: tuple[str, ...] = ("prefix_cache", "kv_cache", "gdn_state", "conv_state")
"""Cached state that an event may invalidate (``claims.state``)."""


@dataclass(frozen=True)
class F32:
    """A float constant pinned as IEEE-754 binary32.

    Args:
        value: any Python float; it is rounded to the nearest float32 at construction
            (``F32(0.1).value == 0.10000000149011612``).

    Raises:
        OverflowError: if ``value`` is finite but out of float32 range.
    """

    value: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", struct.unpack("<f", struct.pack("<f", float(self.value)))[0])

    @property
    def bits(self) -> int:
        """The 32-bit pattern as an unsigned int."""
        return struct.unpack("<I", struct.pack("<f", self.value))[0]

    def __eq__(self, other: object) -> bool:  # bitwise, so -0.0 != 0.0 and NaN == NaN
        return isinstance(other, F32) and other.bits == self.bits

    def __hash__(self) -> int:
        return hash(("f32", self.bits))


Constant = Union[int, bool, str, float, F32]
"""A pinned constant value. ``float`` means float64; wrap in :class:`F32` for float32."""


def _frozen_map(m: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(m or {}))


def _frozen_value(v: Any) -> Any:
    """Deep copy of JSON-like data into immutable containers (dict -> mappingproxy, list -> tuple)."""
    if isinstance(v, Mapping):
        return MappingProxyType({k: _frozen_value(x) for k, x in v.items()})
    if isinstance(v, (list, tuple)):
        return tuple(_frozen_value(x) for x in v)
    return v


@dataclass(frozen=True)
class CompositionEntry:
    """The implementation of one region in one or more cases.

    Args:
        region: a region name from :data:`REGIONS` (or an explicit extension), e.g. ``"gdn.core"``.
        cases: the cases this entry covers, e.g. ``("trainer_fwd", "engine_prefill")``.
        impl: implementation id, e.g. ``"isoexec.cpr_gdn.triton"``.
        version: implementation version string, e.g. ``"1"``.
        arch: target architecture, e.g. ``"sm90"``, ``"cpu"`` or ``"any"``.
        constants: pinned constants, name -> ``int | bool | str | float | F32``
            (e.g. ``{"chunk_size": 64, "acc_dtype": "float32"}``).
        proof: discharge reference, the gate or test id that proves the entry bitwise,
            e.g. ``"gates/gdn.core/prefill=decode"``.
    """

    region: str
    cases: tuple[str, ...]
    impl: str
    version: str
    arch: str
    constants: Mapping[str, Constant] = field(default_factory=dict)
    proof: str = ""

    def __post_init__(self) -> None:
        cases = (self.cases,) if isinstance(self.cases, str) else tuple(self.cases)
        object.__setattr__(self, "cases", cases)
        object.__setattr__(self, "constants", _frozen_map(self.constants))


@dataclass(frozen=True)
class TopologyClaim:
    """Claim on one parallel dimension: an invariant domain, a pinned degree, or both.

    Args:
        domain: degrees under which the composition is proven invariant, e.g. ``(1, 2, 4, 8)``.
            Empty means "only ``pinned``".
        pinned: if set, the one degree allowed at run time (must lie in ``domain`` when both given).
    """

    domain: tuple[int, ...] = ()
    pinned: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "domain", tuple(self.domain))

    def allowed(self) -> tuple[int, ...]:
        """Degrees allowed at run time: ``(pinned,)`` if pinned, else the domain."""
        return (self.pinned,) if self.pinned is not None else tuple(sorted(set(self.domain)))


@dataclass(frozen=True)
class Claims:
    """Conditions under which the composition holds.

    Args:
        topology: parallel dimension (``tp``, ``ep``, ``sp``, ``pp``, ``dp``, ``cp``) -> :class:`TopologyClaim`.
            Unclaimed dimensions are pinned to 1.
        state: event name (``weight_sync``, ``preemption``, ...) -> states it invalidates
            (names from :data:`STATES`).
        tolerances: metric -> maximum allowed value (finite, >= 0), e.g. ``{"logprob_abs_diff": 0.0}``.
            Ints are accepted and encoded as float64.
        engine: engine settings that must hold, e.g. ``{"enable_prefix_caching": False}``.
    """

    topology: Mapping[str, TopologyClaim] = field(default_factory=dict)
    state: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    tolerances: Mapping[str, float] = field(default_factory=dict)
    engine: Mapping[str, Constant] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "topology", _frozen_map(self.topology))
        state = {k: ((v,) if isinstance(v, str) else tuple(v)) for k, v in dict(self.state or {}).items()}
        object.__setattr__(self, "state", MappingProxyType(state))
        object.__setattr__(self, "tolerances", _frozen_map(self.tolerances))
        object.__setattr__(self, "engine", _frozen_map(self.engine))


@dataclass(frozen=True)
class Identities:
    """The three SHA-256 hex digests of a contract (see :mod:`isoexec.contract.identity`).

    Args:
        semantic: logical model + cases.
        numerical_policy: semantic + composition + claims; the handshake key.
        deployment: settings proven not to change bits; logged, never required to match.
    """

    semantic: str
    numerical_policy: str
    deployment: str


@dataclass(frozen=True)
class ExecutionContract:
    """A declarative, hashable record of every execution choice that can change bits.

    Build it with :meth:`build`, which validates and computes the identities; the plain constructor
    is for decoders and does neither.

    Args:
        model: caller's description of the logical model (JSON-like mapping; e.g.
            ``{"architecture": "Qwen3NextForCausalLM", "config_sha256": "..."}``).
        cases: covered cases (subset of :data:`CASES`).
        composition: one :class:`CompositionEntry` per (region, set of cases).
        claims: :class:`Claims`.
        deployment: settings proven not to change bits (JSON-like mapping), e.g. memory sizing.
        identities: :class:`Identities` over the fields above.
    """

    model: Mapping[str, Any]
    cases: tuple[str, ...]
    composition: tuple[CompositionEntry, ...]
    claims: Claims
    deployment: Mapping[str, Any]
    identities: Identities

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", _frozen_value(self.model))
        cases = (self.cases,) if isinstance(self.cases, str) else tuple(self.cases)
        object.__setattr__(self, "cases", cases)
        object.__setattr__(self, "composition", tuple(self.composition))
        object.__setattr__(self, "deployment", _frozen_value(self.deployment))

    @classmethod
    def build(
        cls,
        model: Mapping[str, Any],
        cases: Sequence[str],
        composition: Sequence[CompositionEntry],
        claims: Claims,
        deployment: Mapping[str, Any] | None = None,
        *,
        regions: Sequence[str] = REGIONS,
    ) -> "ExecutionContract":
        """Validate the parts and return a contract with its identities computed.

        Args:
            model: logical model description, e.g. architecture + config digest (JSON-like mapping;
                floats are encoded as float64 bit patterns).
            cases: covered cases.
            composition: composition entries, in any order (digests do not depend on it).
            claims: :class:`Claims`.
            deployment: settings proven not to change bits (default: empty).
            regions: known region names (default :data:`REGIONS`; pass a superset to extend).

        Returns:
            A validated :class:`ExecutionContract`.

        Raises:
            ContractValidationError: listing every violation found.
        """
        from .identity import compute_identities
        from .validate import validate

        draft = cls(model, tuple(cases), tuple(composition), claims, deployment or {}, Identities("", "", ""))
        validate(draft, regions=regions, check_identities=False)
        return draft.with_identities(compute_identities(draft))

    def __eq__(self, other: object) -> bool:
        """Equal when the canonical encodings (content and identities) are byte-identical, so
        ``-0.0`` and ``0.0`` constants differ and equal contracts hash equal."""
        from .canonical import encode

        return isinstance(other, ExecutionContract) and encode(self) == encode(other)

    def __hash__(self) -> int:
        from .canonical import encode

        return hash(encode(self))

    def with_identities(self, identities: Identities) -> "ExecutionContract":
        """Return a copy carrying ``identities`` (no checks)."""
        return ExecutionContract(self.model, self.cases, self.composition, self.claims, self.deployment, identities)

    def rebuild(self, **changes: Any) -> "ExecutionContract":
        """Return a validated copy with some fields replaced and identities recomputed.

        Args:
            **changes: any of ``model``, ``cases``, ``composition``, ``claims``, ``deployment``,
                ``regions``.

        Raises:
            ContractValidationError: as :meth:`build`.
        """
        parts = dict(
            model=self.model,
            cases=self.cases,
            composition=self.composition,
            claims=self.claims,
            deployment=self.deployment,
        )
        parts.update(changes)
        return ExecutionContract.build(**parts)
