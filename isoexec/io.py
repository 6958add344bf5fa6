"""Atomic file writes shared by every layer.

Each writer serializes first, then writes a temporary file in the destination's folder, flushes and
fsyncs it, and renames it over the destination with ``os.replace`` (atomic on POSIX). A reader
therefore sees either the old file or the complete new one, never a partial write; if anything
fails, the old file is left untouched and the temporary file is removed. Parent folders are created.
"""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_write_json", "csv_text", "write_csv"]


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically.

    The new file keeps the mode of the file it replaces, or gets 0o644.

    Args:
        path: destination file; missing parent folders are created.
        data: the complete content.

    Returns:
        The destination as a :class:`~pathlib.Path`.

    Raises:
        TypeError: if ``data`` is not bytes-like.
        OSError: if the folder cannot be created or the file written/renamed (old file intact).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"atomic_write_bytes needs bytes, got {type(data).__name__}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_write_bytes`).

    Raises:
        TypeError: if ``text`` is not a str.
        OSError: as :func:`atomic_write_bytes`.
    """
    if not isinstance(text, str):
        raise TypeError(f"atomic_write_text needs str, got {type(text).__name__}")
    return atomic_write_bytes(path, text.encode(encoding))


def atomic_write_json(path: str | os.PathLike, obj: Any, **dumps_kwargs: Any) -> Path:
    """Write ``obj`` as JSON to ``path`` atomically, with a trailing newline.

    Args:
        path: destination file.
        obj: JSON-serializable object; serialized before the file is touched.
        **dumps_kwargs: passed to :func:`json.dumps`; defaults ``indent=2, sort_keys=True,
            ensure_ascii=False``.

    Raises:
        TypeError, ValueError: if ``obj`` cannot be serialized (nothing is written).
        OSError: as :func:`atomic_write_bytes`.
    """
    opts = {"indent": 2, "sort_keys": True, "ensure_ascii": False, **dumps_kwargs}
    return atomic_write_text(path, json.dumps(obj, **opts) + "\n")


def csv_text(rows: Iterable[Mapping[str, Any]], columns: Sequence[str] | None = None,
             fmt: Callable[[str, Any], Any] | None = None) -> str:
    """CSV text of ``rows`` (one dict each), the one CSV writer of the project.

    Args:
        rows: the records. columns: column order (default: keys in first-seen order over all rows;
            a missing key is an empty cell). fmt: ``(column, value) -> cell`` (default: floats as
            ``%.4g``, everything else as is).
    """
    rows = list(rows)
    if columns is None:
        columns = []
        for r in rows:
            columns += [k for k in r if k not in columns]
    fmt = fmt or (lambda _c, v: f"{v:.4g}" if isinstance(v, float) else v)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(columns))
    w.writeheader()
    for r in rows:
        w.writerow({k: fmt(k, v) for k, v in r.items()})
    return buf.getvalue()


def write_csv(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]], columns: Sequence[str] | None = None,
              fmt: Callable[[str, Any], Any] | None = None) -> Path:
    """Write :func:`csv_text` of ``rows`` to ``path`` atomically."""
    return atomic_write_text(path, csv_text(rows, columns, fmt))


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable (best effort: not all platforms can open a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
