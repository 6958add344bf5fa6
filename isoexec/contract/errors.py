"""Exceptions of the contract package. All derive from :class:`ContractError`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


class ContractError(Exception):
    """Base class of every error raised by :mod:`isoexec.contract`."""


@dataclass(frozen=True)
class Violation:
    """One problem found in a contract.

    Args:
        path: field path, e.g. ``composition[gdn.core].constants.chunk_size``.
        message: what is wrong, naming the allowed values where there is a fixed set.
    """

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class _ViolationList(ContractError):
    """An error carrying a list of :class:`Violation` (all of them, not only the first)."""

    headline = "violation"

    def __init__(self, violations: Sequence[Violation], source: str | None = None):
        self.violations = list(violations)
        self.source = source
        where = f"{source}: " if source else ""
        lines = [f"{where}{len(self.violations)} {self.headline}(s):"]
        lines += [f"  - {v}" for v in self.violations]
        super().__init__("\n".join(lines))


class ContractValidationError(_ViolationList, ValueError):
    """The contract breaks one or more rules; ``.violations`` lists every one."""

    headline = "contract violation"


class ContractDecodeError(_ViolationList, ValueError):
    """Encoded contract text is malformed, has unknown/missing fields, raw floats or bad bit patterns."""

    headline = "decode error"


class ContractTampered(ContractError):
    """A stored contract's content no longer matches its stored identities.

    Attributes:
        identities: names of the identities that no longer match (e.g. ``["numerical_policy"]``).
        fields: field paths whose content changed (e.g. ``["composition[gdn.core].constants.chunk_size"]``).
    """

    def __init__(self, message: str, identities: Sequence[str], fields: Sequence[str]):
        self.identities = list(identities)
        self.fields = list(fields)
        super().__init__(message)


class ContractMismatch(ContractError):
    """Handshake refused: the two sides' ``numerical_policy`` digests differ.

    Attributes:
        local: local ``numerical_policy`` digest.
        remote: remote ``numerical_policy`` digest.
        differences: human-readable differences behind them (see :func:`~isoexec.contract.diff`).
    """

    def __init__(self, local: str, remote: str, differences: Sequence[str]):
        self.local = local
        self.remote = remote
        self.differences = list(differences)
        lines = [f"execution contract mismatch: numerical_policy local {local} != remote {remote}"]
        lines += [f"  - {d}" for d in self.differences] or ["  (no field differences found)"]
        super().__init__("\n".join(lines))


class ClaimViolation(_ViolationList):
    """A runtime condition (topology degree, engine setting) contradicts the contract's claims."""

    headline = "claim violation"
