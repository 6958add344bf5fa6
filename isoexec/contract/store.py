"""Saving and loading contracts as files, with tamper detection.

File format: the canonical document of :func:`~isoexec.contract.canonical.to_obj` (with its
``identities``) plus a ``field_digests`` map ``field path -> short digest`` (see
:func:`~isoexec.contract.identity.field_digests`), all as canonical JSON bytes. Loading recomputes
the identities from the content; if one no longer matches, the field digests name the field(s) that
were edited (e.g. ``composition[gdn.core].constants.chunk_size``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from ..io import atomic_write_bytes
from .canonical import dumps, from_obj, parse_json, to_obj
from .errors import ContractDecodeError, ContractTampered, Violation
from .identity import IDENTITY_NAMES, changed_fields, compute_identities, field_digests, identities_of_path
from .schema import REGIONS, ExecutionContract
from .validate import validate

FIELD_DIGESTS = "field_digests"


def to_file_bytes(c: ExecutionContract) -> bytes:
    """The bytes :func:`save` writes: canonical JSON of the contract plus its field digests.

    Raises:
        TypeError: if some value cannot be encoded.
    """
    doc = to_obj(c)
    doc[FIELD_DIGESTS] = field_digests(c)
    return dumps(doc)


def save(c: ExecutionContract, path: str | os.PathLike, *, regions: Sequence[str] = REGIONS) -> Path:
    """Validate ``c`` and write it to ``path`` atomically (temp file in the same folder, fsync,
    ``os.replace``). On any error the previous file is left intact.

    Args:
        c: a contract (its identities must match its content: use ``ExecutionContract.build``).
        path: destination file; parent folders are created.
        regions: known region names.

    Returns:
        The destination path.

    Raises:
        ContractValidationError: if ``c`` breaks a rule or its identities are stale.
        TypeError: if some value cannot be encoded.
        OSError: if the file cannot be written.
    """
    validate(c, regions=regions)
    return atomic_write_bytes(path, to_file_bytes(c))


def loads(data: str | bytes, source: str = "<contract>", *, regions: Sequence[str] = REGIONS) -> ExecutionContract:
    """Decode file content, re-verify its identities, and validate it.

    Args:
        data: file content.
        source: name for messages (the path).
        regions: known region names.

    Returns:
        The contract.

    Raises:
        ContractDecodeError: malformed JSON (with line and column), unknown/missing fields, raw floats.
        ContractTampered: content no longer matches the stored identities (names identity and fields).
        ContractValidationError: content breaks a rule.
    """
    obj = parse_json(data, source)
    stored_fields = None
    if isinstance(obj, dict):
        stored_fields = obj.pop(FIELD_DIGESTS, None)
    if not isinstance(stored_fields, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in stored_fields.items()
    ):
        problem = "missing field" if stored_fields is None else "expected an object of field path -> digest"
        try:
            from_obj(obj, source)
        except ContractDecodeError as e:
            if e.violations[0].path == "<json>":  # not a contract at all: its own one line says so
                raise
            raise ContractDecodeError([*e.violations, Violation(FIELD_DIGESTS, problem)], source) from None
        raise ContractDecodeError([Violation(FIELD_DIGESTS, problem)], source)
    c = from_obj(obj, source)
    verify_identities(c, stored_fields, source)
    validate(c, regions=regions, check_identities=False)
    return c


def verify_identities(c: ExecutionContract, stored_fields: dict[str, str], source: str = "<contract>") -> None:
    """Check that ``c.identities`` and ``stored_fields`` match the content of ``c``.

    Raises:
        ContractTampered: naming each identity that no longer matches (stored vs content digest)
            and the field paths whose digests changed.
    """
    now = compute_identities(c)
    bad_ids = [n for n in IDENTITY_NAMES if getattr(now, n) != getattr(c.identities, n)]
    changed = changed_fields(c, stored_fields)
    if not bad_ids and not changed:
        return
    lines = [f"{source}: content no longer matches its stored identities"]
    for n in bad_ids:
        fields = [f for f in changed if n in identities_of_path(f.split(" (")[0])]
        lines.append(f"  identity {n}: stored {getattr(c.identities, n)} != content {getattr(now, n)}")
        if fields:
            lines.append(f"    changed field(s): {', '.join(fields)}")
        else:
            lines.append(f"    no field changed: the stored identity {n} itself was edited")
    if not bad_ids:
        lines.append(f"  identities match, but {FIELD_DIGESTS} disagree for: {', '.join(changed)}")
    raise ContractTampered("\n".join(lines), bad_ids, [f.split(" (")[0] for f in changed])


def load(path: str | os.PathLike, *, regions: Sequence[str] = REGIONS) -> ExecutionContract:
    """Read a contract file written by :func:`save`, re-verifying its identities.

    Args:
        path: the file.
        regions: known region names.

    Raises:
        OSError: if the file cannot be read.
        ContractDecodeError, ContractTampered, ContractValidationError: as :func:`loads`, with the
            file name in the message.
    """
    return loads(Path(path).read_bytes(), str(path), regions=regions)
