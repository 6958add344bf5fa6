"""isoexec's entry points (the vLLM plugin among them) where isoexec runs from PYTHONPATH, not pip-installed.

vLLM loads its plugins through ``importlib.metadata.entry_points(group="vllm.general_plugins")``
(``vllm/plugins/__init__.py``, ``load_plugins_by_group``), which reads the distribution records
(``*.dist-info``) of the folders on ``sys.path``. A checkout that is only on ``PYTHONPATH`` (the GPU node:
``workflow/scripts/gpu_node.sh``) has no record, so no vLLM process there would register the isoexec
architecture, and SkyRL's vLLM servers of the recipe's isoexec arm could not build it.

:func:`write_record` writes the record pip would write for the entry points, ``isoexec-<version>.dist-info``
with ``METADATA`` and ``entry_points.txt`` (the Python packaging specifications "Recording installed projects"
and "Entry points specification"), from the ``[project.entry-points]`` tables of ``pyproject.toml`` (their one
source), into a folder that is on ``sys.path`` next to the checkout::

    python -m isoexec.engines.plugin_record /tmp/site     # gpu_node.sh install does this
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def entry_points_text(pyproject: Path = PYPROJECT) -> tuple[str, str, str]:
    """``(name, version, entry_points.txt text)`` from ``pyproject``'s ``[project]`` table.

    Raises:
        ValueError: ``pyproject`` declares no ``[project.entry-points]`` table.
    """
    project = tomllib.loads(pyproject.read_text())["project"]
    groups = project.get("entry-points") or {}
    if not groups:
        raise ValueError(f"{pyproject} has no [project.entry-points] table")
    text = "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for g, eps in groups.items())
    return project["name"], project["version"], text


def write_record(folder: str | Path, pyproject: Path = PYPROJECT) -> Path:
    """Write ``<folder>/<name>-<version>.dist-info/{METADATA,entry_points.txt}``; returns the record's folder.

    Idempotent (rewrites the two files). ``folder`` must be on ``sys.path`` of the processes that should see the
    entry points (``PYTHONPATH``).

    Raises:
        FileNotFoundError: ``folder`` does not exist.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"record folder {str(folder)!r} does not exist (a folder on PYTHONPATH, e.g. /tmp/site)")
    name, version, text = entry_points_text(pyproject)
    record = folder / f"{name}-{version}.dist-info"
    record.mkdir(exist_ok=True)
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (record / "entry_points.txt").write_text(text)
    return record


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m isoexec.engines.plugin_record FOLDER_ON_PYTHONPATH")
    print(f"wrote {write_record(sys.argv[1])}")
