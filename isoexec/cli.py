"""The ``isoexec`` command line (typer). Each layer owns its commands; this module only wires them.

Commands: ``contract show|diff|verify`` (isoexec.contract.cli), ``gates`` and ``bench``
(isoexec.model.gates, isoexec.bench), ``rollout-check`` (isoexec.engines.rollout_check),
``rl ...`` (isoexec.rl.cli), ``report ...`` (isoexec.report.cli), ``pik-check``
(isoexec.kernels.collectives: TP-invariant row-parallel GEMM over gloo).
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__.splitlines()[0])

# Sub-applications: (module, attribute, group name)
_GROUPS = [
    ("isoexec.contract.cli", "app", "contract"),
    ("isoexec.rl.cli", "app", "rl"),
    ("isoexec.report.cli", "app", "report"),
]
# Single commands: (module, function, command name)
_COMMANDS = [
    ("isoexec.model.gates", "gates_command", "gates"),
    ("isoexec.bench.cpu", "bench_command", "bench"),
    ("isoexec.engines.rollout_check", "rollout_check_command", "rollout-check"),
    ("isoexec.kernels.collectives.check", "pik_check_command", "pik-check"),
]

for _mod, _attr, _name in _GROUPS:
    app.add_typer(getattr(importlib.import_module(_mod), _attr), name=_name)
for _mod, _attr, _name in _COMMANDS:
    app.command(_name)(getattr(importlib.import_module(_mod), _attr))


if __name__ == "__main__":
    app()
