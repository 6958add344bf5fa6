"""The `isoexec` command line (typer). Each layer owns its commands; this module wires them and owns
the one error style of every command.

Commands: `contract show|diff|verify` (isoexec.contract.cli), `gates` and `bench`
(isoexec.model.gates, isoexec.bench), `rollout-check` (isoexec.engines.rollout_check), `engine-options`
(isoexec.engines.options: what isoexec mode refuses, as Markdown),
`rl ...` (isoexec.rl.cli), `report ...` (isoexec.report.cli), `pik-check`
(isoexec.kernels.collectives: TP-invariant row-parallel GEMM over gloo), `config` (isoexec.settings:
the validated experiment config, recorded beside its results).

Errors: a command that meets bad input (a missing or invalid file, a value outside what is allowed)
raises; :class:`IsoexecGroup` prints one line, `error: <message>`, to stderr and exits 2. Any other
exception is an internal error: one line naming its type, exit 1. `isoexec --debug ...` re-raises
instead, with the traceback. The workflow's config loading prints the same line through
:func:`error_line`.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Sequence
from typing import Any

import typer
from typer.core import TyperGroup

# click's exception classes as typer raises them: the module of the public ``typer.BadParameter``
# (typer vendors click as ``typer._click``; older releases used click itself).
_click_exc = sys.modules[typer.BadParameter.__module__]

USAGE_EXIT = 2
"""Exit status of every refused input (click's own status for usage errors)."""

INTERNAL_EXIT = 1


def input_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean bad input, reported as one line with exit status 2.

    ``ValueError`` (pydantic's ``ValidationError``, ``InputError``, ``MetricsError`` and the contract's
    decode and validation errors derive from it), ``OSError`` (a missing or unreadable file) and
    every :class:`isoexec.contract.ContractError` (a tampered or mismatched contract).
    """
    from isoexec.contract.errors import ContractError

    return (ValueError, OSError, ContractError)


def error_line(exc: BaseException | str) -> str:
    """``error: <message>`` on one line: a multi-line message (a list of violations) is joined with ``; ``.

    Args:
        exc: the exception (or message) to report.

    Returns:
        The line, without a trailing newline.
    """
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        exc = f"{exc.filename}: {exc.strerror}"  # not "[Errno 2] ..."
    lines = [re.sub(r"^- +", "", ln.strip()) for ln in str(exc).splitlines()]  # "  - item" of a list
    lines = [ln for ln in lines if ln]
    text = ""
    for ln in lines:
        text += ln if not text else (" " if text.endswith(":") else "; ") + ln
    if isinstance(exc, BaseException) and not text:
        text = type(exc).__name__
    return f"error: {text}"


def given_value(args: Sequence[str], opts: Sequence[str]) -> str | None:
    """The value typed for an option (``--steps -5`` or ``--steps=-5``) among ``args``; None if not there."""
    for i, a in enumerate(args):
        for o in opts:
            if a == o and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(f"{o}="):
                return a[len(o) + 1:]
    return None


def _debug_requested(args: Sequence[str]) -> bool:
    """``--debug`` among the global options (the words before the first command name)."""
    for a in args:
        if not a.startswith("-"):
            return False
        if a == "--debug":
            return True
    return False


class HelpGroup(TyperGroup):
    """A command group whose ``--help`` lists each command with its summary (``short_help``, else the
    first paragraph of its help) whole and wrapped; click would cut it at the first period or at the
    terminal width, with "..."."""

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                summary = cmd.short_help or inspect.cleandoc(cmd.help or "").split("\n\n")[0]
                rows.append((name, " ".join(summary.split())))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


class IsoexecGroup(HelpGroup):
    """The top-level command group: runs a command and turns what it raises into one ``error:`` line.

    Click usage errors (an unknown option, a value of the wrong type, a ``typer.BadParameter``) and
    :func:`input_errors` exit with status 2, other exceptions with 1; ``--debug`` (a global option)
    re-raises them with the traceback. Used by ``isoexec`` itself and by ``typer.testing.CliRunner``.
    """

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        if not standalone_mode:
            return super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        debug = _debug_requested(argv)
        try:
            rv = super().main(argv, "isoexec", complete_var, standalone_mode=False, **extra)
        except _click_exc.NoArgsIsHelpError:  # `isoexec` or `isoexec rl` alone: typer printed the help
            sys.exit(0)
        except _click_exc.UsageError as e:
            if debug:
                raise
            where = f"{e.ctx.command_path}: " if e.ctx is not None else ""
            msg = e.format_message()
            param = getattr(e, "param", None)
            value = given_value(argv, param.opts) if param is not None and getattr(param, "opts", None) else None
            if value is not None:  # click names the option, not what was typed
                msg = msg.replace(f"'{param.opts[0]}'", f"'{param.opts[0]}' ({value!r})", 1)
            typer.echo(error_line(f"{where}{msg}"), err=True)
            sys.exit(USAGE_EXIT)
        except _click_exc.ClickException as e:
            if debug:
                raise
            typer.echo(error_line(e.format_message()), err=True)
            sys.exit(e.exit_code)
        except typer.Abort:
            typer.echo("error: aborted", err=True)
            sys.exit(INTERNAL_EXIT)
        except Exception as e:  # every command's errors end here: one line, or the traceback with --debug
            if debug:
                raise
            if isinstance(e, input_errors()):
                typer.echo(error_line(e), err=True)
                sys.exit(USAGE_EXIT)
            typer.echo(error_line(f"internal error: {type(e).__name__}: {e}") +
                       " (rerun with isoexec --debug for the traceback)", err=True)
            sys.exit(INTERNAL_EXIT)
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(
    cls=IsoexecGroup,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: paragraphs joined into sentences, flags as --x / --no-x
)


@app.callback()
def _global_options(
    debug: bool = typer.Option(False, "--debug", help="on an error, show the full traceback instead of one line"),
) -> None:
    """IsoExec: bitwise-identical logprobs between an RL trainer and its rollout engine.

    An error prints one line, error: ..., and exits with status 2 (bad input) or 1 (internal error).
    """


# Sub-applications: (module, attribute, group name, one-line summary in `isoexec --help`)
_GROUPS = [
    ("isoexec.contract.cli", "app", "contract", "Show, compare and verify execution contracts."),
    ("isoexec.rl.cli", "app", "rl", "Tiny checkpoint, SFT warm start and the paired RL runs."),
    ("isoexec.report.cli", "app", "report", "Tables, figures and the notebook of an experiment."),
]
# Single commands: (module, function, command name, one-line summary in `isoexec --help`)
_COMMANDS = [
    ("isoexec.model.gates", "gates_command", "gates", "Run the bitwise gate matrix of an experiment."),
    ("isoexec.bench.cpu", "bench_command", "bench", "Time the isoexec kernels against the native ones."),
    ("isoexec.engines.rollout_check", "rollout_check_command", "rollout-check",
     "Recompute vLLM's rollouts with the trainer, per mode."),
    ("isoexec.engines.options", "options_command", "engine-options",
     "Print what isoexec mode refuses (every vLLM option classified) as Markdown."),
    ("isoexec.kernels.collectives.check", "pik_check_command", "pik-check",
     "Check the TP-invariant row-parallel GEMM over gloo."),
    ("isoexec.settings", "config_command", "config", "Print an experiment's settings, defaults filled in."),
]

for _mod, _attr, _name, _short in _GROUPS:
    app.add_typer(getattr(importlib.import_module(_mod), _attr), name=_name, short_help=_short, cls=HelpGroup)
for _mod, _attr, _name, _short in _COMMANDS:
    app.command(_name, short_help=_short)(getattr(importlib.import_module(_mod), _attr))


if __name__ == "__main__":
    app()
