"""The settings record of an experiment's results: ``results/<exp>/experiment.json``.

Results are stored under the experiment's ``name``. So that a changed config can neither overwrite the
results of that name nor be silently taken as up to date, ``reproduce`` records the validated config
(every section, defaults filled in: :func:`settings_record`) beside the results, and the workflow
refuses to start (:func:`settings_conflict`) when the config it is given has the name of a record
whose settings differ. The user then picks a new ``name`` or deletes ``results/<name>/``.

Comparison (:func:`settings_differences`): settings are compared leaf by leaf (``rl.steps``,
``trainer.backend.native``). A setting the record does not have (added to the schema after the
record was written) counts only if it is not at its default; a recorded setting the schema no
longer has is ignored. A setting that changed shape (a mapping ``trainer.backend: {native: hf, ...}``
now a single value ``megatron``, or the reverse) is one difference, reported whole.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from isoexec.config import ExperimentConfig, load_config

RECORD = "experiment.json"
"""File name of the record inside ``results/<exp>/``."""

CONFIG_OPTION = typer.Option(..., "--config", metavar="FILE",
                             help="the experiment: a YAML file such as experiments/cpu-tiny.yaml, or the "
                             "settings record results/<exp>/experiment.json")
"""The ``--config`` option of every command that runs an experiment (required everywhere)."""


def settings_record(cfg: ExperimentConfig) -> dict[str, Any]:
    """The validated config as JSON-ready data, every default filled in."""
    return cfg.model_dump(mode="json")


def record_text(cfg: ExperimentConfig) -> str:
    """:func:`settings_record` as the text of ``experiment.json`` (sorted keys, two-space indent)."""
    return json.dumps(settings_record(cfg), indent=2, sort_keys=True) + "\n"


def write_record(cfg: ExperimentConfig, path: str | Path) -> Path:
    """Write ``cfg``'s settings record to ``path`` (atomically); returns the path."""
    from isoexec.io import atomic_write_text

    return atomic_write_text(Path(path), record_text(cfg))


def _leaves(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_leaves(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def settings_differences(recorded: dict[str, Any], cfg: ExperimentConfig) -> list[str]:
    """The settings of ``cfg`` that differ from a record, as ``"key: recorded -> now"``.

    Args:
        recorded: the content of a record (:func:`settings_record` of the config that made the results).
        cfg: the config to run now.

    Returns:
        One entry per differing leaf or reshaped setting, sorted; empty if the settings agree.
    """
    now = settings_record(cfg)
    old, new = _leaves(recorded), _leaves(now)
    default = _leaves(settings_record(ExperimentConfig(name=cfg.name)))
    reshaped = {p for key in old.keys() ^ new.keys() for p in _prefixes(key) if p in old or p in new}
    out = [f"{key}: {json.dumps(_get(recorded, key))} -> {json.dumps(_get(now, key))}" for key in reshaped]
    for key in new:
        if any(p in reshaped for p in _prefixes(key)) or key in reshaped:
            continue
        if key in old:
            if old[key] != new[key]:
                out.append(f"{key}: {json.dumps(old[key])} -> {json.dumps(new[key])}")
        elif key in default and new[key] != default[key]:
            out.append(f"{key}: not recorded -> {json.dumps(new[key])}")
    return sorted(out)


def _prefixes(key: str) -> list[str]:
    """``"a.b.c"`` -> ``["a", "a.b"]``."""
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _get(record: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        record = record[part]
    return record


def settings_conflict(cfg: ExperimentConfig, config_path: str | Path) -> str | None:
    """Why ``cfg`` must not run under its name, or None when it may.

    Args:
        cfg: the validated config.
        config_path: its file (named in the message).

    Returns:
        None if ``<out_dir>/experiment.json`` does not exist or records the same settings; else one
        line naming the differing settings, the folder, and what to do.

    Raises:
        ValueError: the record exists but is not a JSON object.
    """
    record = cfg.out_dir / RECORD
    if not record.is_file():
        return None
    try:
        recorded = json.loads(record.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{record}: not valid JSON ({e}); delete it or restore it from git") from None
    if not isinstance(recorded, dict):
        raise ValueError(f"{record}: expected a JSON object of settings, got {type(recorded).__name__}")
    diffs = settings_differences(recorded, cfg)
    if not diffs:
        return None
    shown = "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
    return (f"{config_path}: {cfg.out_dir}/ holds results of experiment {cfg.name!r} made with other settings "
            f"({shown}); give this config a new name, or delete {cfg.out_dir}/ to recompute it")


def config_command(
    config: Path = CONFIG_OPTION,
    out: Path = typer.Option(None, metavar="FILE", help="write the record to this file instead of printing it "
                             "(reproduce writes results/<exp>/experiment.json)"),
) -> None:
    """Print the validated experiment config with every default filled in: the settings record of its results."""
    cfg = load_config(config)
    if out is None:
        typer.echo(record_text(cfg), nl=False)
    else:
        write_record(cfg, out)
        typer.echo(f"wrote {out}")
