"""The analysis notebook executed for one experiment (papermill) and exported to HTML (nbconvert),
with stable output: the same results give the same bytes, so a rerun leaves a clean clone clean.

Papermill records, per run, start/end times and durations (notebook and cells), the kernel's
message timestamps (``execution`` cell metadata), the input path as given (absolute in the
workflow) and a random id for the cell it injects. :func:`stable_notebook` drops the times, keeps the
input path relative to the working directory and gives the injected cell a fixed id; everything
else (outputs, parameters, kernel and language info) is kept.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

INJECTED_ID = "injected-parameters"
"""Cell id of the parameters cell papermill injects (its tag has the same name)."""

_VOLATILE = ("start_time", "end_time", "duration")


def _relative(path: str | None) -> str | None:
    if not path:
        return path
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def stable_notebook(nb: Any) -> Any:
    """Remove what changes from one execution to the next (in place); returns ``nb``.

    Args:
        nb: an executed ``nbformat.NotebookNode`` (papermill's output).
    """
    pm = nb.metadata.get("papermill", {})
    for k in _VOLATILE:
        pm.pop(k, None)
    for k in ("input_path", "output_path"):
        if k in pm:
            pm[k] = _relative(pm[k])
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        for k in _VOLATILE:
            cell.metadata.get("papermill", {}).pop(k, None)
        if INJECTED_ID in cell.metadata.get("tags", []):
            cell["id"] = INJECTED_ID
        if cell.get("outputs"):
            cell["outputs"] = _merged_streams(cell["outputs"])
    return nb


def _merged_streams(outputs: list) -> list:
    """Consecutive ``stream`` outputs of one name joined into one: the kernel splits a cell's stdout
    wherever a flush happened to fall, which differs from one execution to the next."""
    merged: list = []
    for out in outputs:
        prev = merged[-1] if merged else None
        if (out.get("output_type") == "stream" and prev is not None and prev.get("output_type") == "stream"
                and prev.get("name") == out.get("name")):
            text = lambda o: o["text"] if isinstance(o["text"], str) else "".join(o["text"])  # noqa: E731
            prev["text"] = text(prev) + text(out)
        else:
            merged.append(out)
    return merged


def run_notebook(notebook: str | Path, exp_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """Execute ``notebook`` with parameter ``exp_dir``; write ``<out_dir>/<name>.ipynb`` and ``.html`` (titled
    ``<exp>: IsoExec analysis``).

    Args:
        notebook: the source notebook (a ``parameters``-tagged cell takes ``exp_dir``).
        exp_dir: the experiment's results folder, e.g. ``results/cpu-tiny``.
        out_dir: where the executed notebook and its HTML export go.

    Returns:
        The two paths written (each atomically).

    Raises:
        FileNotFoundError: ``notebook`` or ``exp_dir`` does not exist.
        papermill.exceptions.PapermillExecutionError: a cell failed (nothing is written).
    """
    import nbformat
    import papermill
    from nbconvert import HTMLExporter

    from isoexec.io import atomic_write_text

    notebook, exp_dir, out_dir = Path(notebook), Path(exp_dir), Path(out_dir)
    for p in (notebook, exp_dir):
        if not p.exists():
            raise FileNotFoundError(f"{p} does not exist")
    nb = papermill.execute_notebook(str(notebook), None, parameters={"exp_dir": str(exp_dir)},
                                    kernel_name="python3", progress_bar=False, log_output=True)
    stable_notebook(nb)
    ipynb = atomic_write_text(out_dir / f"{notebook.stem}.ipynb", nbformat.writes(nb) + "\n")
    # the page title names the experiment (nbconvert's templates take it from the resources' metadata name;
    # without it a notebook converted from memory is titled "Notebook")
    html, _ = HTMLExporter().from_notebook_node(nb, resources={"metadata": {"name": f"{exp_dir.name}: IsoExec analysis"}})
    return [ipynb, atomic_write_text(out_dir / f"{notebook.stem}.html", html)]
