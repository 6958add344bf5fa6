"""Inputs and outputs of the report layer: per-step RL metrics, run provenance, atomic writes.

Layout read (written by ``isoexec rl paired`` / ``isoexec rl train``)::

    <exp_dir>/rl/<arm>/seed<k>/metrics.jsonl     one JSON object per RL step
    <exp_dir>/rl/<arm>/seed<k>/provenance.json   git commit, machine, device, versions, command, date

An arm (:mod:`isoexec.rl.arms`) is a mode (``native``, ``isoexec``) or a mode's stack with SkyRL's
off-policy correction (e.g. ``native-tis``); rows carry ``arm`` and ``mode`` (rows written before
arms existed carry only ``mode``, which is then their arm).

Every file the report layer writes goes through :mod:`isoexec.io` (temp file in the same folder,
fsync, ``os.replace``), so a failed or interrupted write leaves the previous file intact.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import pandas as pd

from isoexec.io import atomic_write_bytes, atomic_write_text
from isoexec.provenance import provenance

__all__ = ["atomic_write_bytes", "atomic_write_text", "MetricsError", "discover_runs", "load_metrics"]

# Keys every metrics.jsonl row must carry for the tables and figures (others are kept if present).
REQUIRED_KEYS: tuple[str, ...] = (
    "step",
    "tokens",
    "mismatch_count",
    "logprob_abs_diff_mean",
    "logprob_abs_diff_std",
    "logprob_abs_diff_max",
    "reward_mean",
    "time/generation",
    "time/train",
    "time/weight_sync",
    "time/step",
)
_RUN_DIR = re.compile(r"^seed(\d+)$")


class MetricsError(ValueError):
    """A metrics file is missing, empty, malformed or inconsistent with its folder."""


# --------------------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------------------


def discover_runs(
    exp_dir: str | Path, arms: Sequence[str] | None = None, seeds: Sequence[int] | None = None
) -> list[tuple[str, int, Path]]:
    """The RL runs of an experiment as ``(arm, seed, run_dir)``, sorted by arm then seed.

    Args:
        exp_dir: ``results/<exp>``.
        arms, seeds: restrict to these (e.g. the experiment's arms and ``rl.seeds``, so stale runs of
            an older config are ignored). Every requested (arm, seed) must exist. ``None``: every run
            found on disk.

    Raises:
        MetricsError: no run found, or a requested run has no ``metrics.jsonl``.
    """
    rl = Path(exp_dir) / "rl"
    found: dict[tuple[str, int], Path] = {}
    if rl.is_dir():
        for mode_dir in sorted(p for p in rl.iterdir() if p.is_dir()):
            for run_dir in sorted(p for p in mode_dir.iterdir() if p.is_dir()):
                m = _RUN_DIR.match(run_dir.name)
                if m and (run_dir / "metrics.jsonl").is_file():
                    found[(mode_dir.name, int(m.group(1)))] = run_dir
    if arms is None and seeds is None:
        runs = found
    else:
        want_arms = list(arms) if arms is not None else sorted({m for m, _ in found})
        want_seeds = list(seeds) if seeds is not None else sorted({s for _, s in found})
        missing = [f"{m}/seed{s}" for m in want_arms for s in want_seeds if (m, s) not in found]
        if missing:
            raise MetricsError(f"{rl}: no metrics.jsonl for run(s) {', '.join(missing)}")
        runs = {(m, s): found[(m, s)] for m in want_arms for s in want_seeds}
    if not runs:
        raise MetricsError(f"{rl}: no RL runs found (expected rl/<arm>/seed<k>/metrics.jsonl)")
    return [(m, s, runs[(m, s)]) for m, s in sorted(runs)]


def read_metrics_file(path: str | Path, arm: str | None = None, seed: int | None = None) -> pd.DataFrame:
    """One run's ``metrics.jsonl`` as a DataFrame sorted by step (one row per step).

    ``arm``/``seed`` (from the folder names) fill missing columns and are checked against the rows
    (a row's arm is its ``arm``, or its ``mode`` in rows written before arms existed).

    Raises:
        MetricsError: unreadable line, missing required key, duplicate step, or a row whose arm/seed
            disagrees with its folder. The message names the file and line.
    """
    path = Path(path)
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise MetricsError(f"{path}:{lineno}: not valid JSON: {e}") from None
        if not isinstance(row, dict):
            raise MetricsError(f"{path}:{lineno}: expected a JSON object")
        missing = [k for k in REQUIRED_KEYS if k not in row]
        if missing:
            raise MetricsError(f"{path}:{lineno}: missing key(s) {', '.join(missing)}")
        row_arm = ("arm", row["arm"]) if "arm" in row else ("mode", row.get("mode"))
        for (key, got), want in ((row_arm, arm), (("seed", row.get("seed")), seed)):
            if want is not None and got is not None and got != want:
                raise MetricsError(f"{path}:{lineno}: {key}={got!r} but the folder says {want!r}")
        rows.append(row)
    if not rows:
        raise MetricsError(f"{path}: no metrics rows")
    df = pd.DataFrame(rows)
    if "arm" not in df:
        df["arm"] = df["mode"] if "mode" in df else arm
    if arm is not None:
        df["arm"] = arm
    if seed is not None:
        df["seed"] = seed
    dup = df["step"][df["step"].duplicated()].tolist()
    if dup:
        raise MetricsError(f"{path}: duplicate step(s) {dup}")
    return df.sort_values("step", kind="stable").reset_index(drop=True)


def load_metrics(
    exp_dir: str | Path, arms: Sequence[str] | None = None, seeds: Sequence[int] | None = None
) -> pd.DataFrame:
    """All per-step metrics of an experiment, one row per (arm, seed, step).

    Columns are the metrics.jsonl keys (``time/...`` keep their slash) plus ``arm`` and ``seed``.
    """
    frames = [read_metrics_file(d / "metrics.jsonl", arm, seed) for arm, seed, d in discover_runs(exp_dir, arms, seeds)]
    df = pd.concat(frames, ignore_index=True)
    df["seed"] = df["seed"].astype(int)
    df["step"] = df["step"].astype(int)
    return df.sort_values(["arm", "seed", "step"], kind="stable").reset_index(drop=True)


# --------------------------------------------------------------------------------------------------
# provenance
# --------------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def report_provenance(
    exp_dir: str | Path, inputs: Iterable[str | Path], run_dirs: Iterable[Path] = ()
) -> dict:
    """Where a report file came from: :func:`isoexec.provenance.provenance` (code version, machine,
    packages, command, date; one schema for every results file) plus the inputs with their SHA-256.

    ``run_dirs``: RL run folders whose ``provenance.json`` is embedded under ``runs`` (``None`` where
    the file is missing).
    """
    runs = {}
    for d in run_dirs:
        p = Path(d) / "provenance.json"
        try:
            runs[str(d)] = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            runs[str(d)] = None
    return {
        **provenance(" ".join([Path(sys.argv[0]).name, *sys.argv[1:]])),
        "exp_dir": str(exp_dir),
        "inputs": [{"path": str(p), "sha256": _sha256(Path(p))} for p in inputs],
        "runs": runs,
    }


def run_git_commit(run_prov: dict | None) -> str | None:
    """The git commit recorded in an RL run's ``provenance.json`` (``git.commit``)."""
    git = run_prov.get("git") if isinstance(run_prov, dict) else None
    return git.get("commit") if isinstance(git, dict) else None


def provenance_lines(prov: dict) -> Iterator[str]:
    """A short human-readable provenance header (one fact per line) for md/tex comments."""
    yield f"generated by: {prov['command']}"
    yield f"date: {prov['date_utc']}"
    git = prov.get("git") or {}
    dirty = " (uncommitted source changes)" if git.get("dirty") else ""
    yield f"git commit: {git.get('commit')}{dirty}"
    yield f"machine: {prov['hostname']} ({prov['platform']}, {prov['cpu']}, device {prov['device']}, python {prov['python']})"
    yield "packages: " + ", ".join(f"{k} {v}" for k, v in prov["packages"].items() if v)
    commits = sorted({str(run_git_commit(r)) for r in prov["runs"].values()})
    if commits:
        yield "RL runs: " + ", ".join(prov["runs"]) + f" (git commit(s): {', '.join(commits)})"
    for inp in prov["inputs"]:
        yield f"input: {inp['path']} sha256={inp['sha256'][:16]}"
