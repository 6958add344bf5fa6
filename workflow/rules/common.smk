# Shared definitions of the workflow: the experiment config, its paths, and per-stage settings.
# No rules here (snakemake --lint wants functions and rules in separate files).
import hashlib
import json
import os
import sys
from pathlib import Path
import shutil

from isoexec.allocator import with_tcmalloc
from isoexec.config import check_device, load_config
from isoexec.rl.arms import arm_names
from isoexec.settings import RECORD, settings_conflict, write_record

DEFAULT_CONFIGFILE = "experiments/cpu-tiny.yaml"


def refuse(problem):
    """Stop before any job with one line, `error: ...` (the isoexec CLI's style), and exit status 2."""
    # imported here, on the error path only: isoexec.cli loads every command's module (torch among them),
    # about 3 s of every snakemake start (each dry run, each test's invocation) for one formatting function
    from isoexec.cli import error_line

    print(error_line(problem), file=sys.stderr)
    sys.exit(2)


def experiment_config_path():
    """The experiment YAML the isoexec commands get: `--config experiment=FILE`, or `--configfile FILE`
    (snakemake reads that file itself first: a misspelled path ends in its own traceback), else the default.
    """
    given = dict(workflow.config_settings.config or {})
    chosen = given.pop("experiment", None)
    if given:
        refuse(
            f"--config {' '.join(f'{k}=...' for k in given)}: the only key taken is experiment=FILE; "
            "every isoexec command reads the experiment YAML itself, so an override would not reach it: "
            "write experiments/<name>.yaml (with its own name) and pass --config experiment=experiments/<name>.yaml"
        )
    files = [str(f) for f in workflow.config_settings.configfiles]
    if len(files) + (chosen is not None) > 1:
        refuse(
            f"pass one experiment (--config experiment=FILE), got {', '.join(files + ([str(chosen)] if chosen else []))}"
        )
    path = Path(
        str(chosen) if chosen is not None else files[0] if files else DEFAULT_CONFIGFILE
    )
    try:  # keep it relative to the working directory where possible (logs, provenance read better)
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def validated_config(path):
    """load_config(path): pydantic validation, then the settings record of results/<name>/: a typo, or
    settings that differ from those the results of this name were made with, stop here before any job.
    """
    try:
        cfg = load_config(path)
        conflict = settings_conflict(cfg, path)
    except (FileNotFoundError, ValueError) as e:
        refuse(e)
    if conflict:
        refuse(conflict)
    return cfg


def settings_digest(*sections):
    """Short SHA-256 of the named config sections; as a rule's param it reruns the rule when they change."""
    dumped = CFG.model_dump(mode="json")
    blob = json.dumps(
        {s: dumped[s] for s in sections}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def run_selection():
    """--arm/--seed options restricting the report to this config's runs (stale runs are ignored)."""
    return " ".join(
        [f"--arm {a}" for a in ARMS] + [f"--seed {s}" for s in CFG.rl.seeds]
    )


CONFIGFILE = experiment_config_path()
CFG = validated_config(CONFIGFILE)
EXP = CFG.name
RES = str(CFG.out_dir)  # results/<exp>: small files only, committed
SETTINGS = f"{RES}/{RECORD}"  # the validated config these results were made with
RUNS = f"runs/{EXP}"  # models and checkpoints, not committed
LOGS = f"logs/{EXP}"
BENCH = f"{RES}/benchmarks"
ARMS = arm_names(CFG)  # rl.modes, then the arms section (isoexec.rl.arms)
RL_METRICS = expand(
    f"{RES}/rl/{{arm}}/seed{{seed}}/metrics.jsonl",
    arm=ARMS,
    seed=CFG.rl.seeds,
)
TABLES = [f"{RES}/tables/summary.{ext}" for ext in ("csv", "md", "tex")]
FIGURES = expand(
    f"{RES}/figures/{{name}}.{{ext}}",
    name=("logprob_diff", "is_ratio", "reward", "time"),
    ext=("png", "pdf"),
)
NOTEBOOK = os.path.join(workflow.basedir, "notebooks", "analysis.ipynb")
# The timed stages (RL runs, benchmarks) reserve all cores, so that they never run side by side with
# anything (the overheads stay honest). The untimed stages before them (init, SFT, gates, rollout
# check) compute on one torch thread (`isoexec ... --threads 1`, the default, the stable choice on
# the shared 2-core machines) and reserve one core: on two cores the SFT runs beside the gates and
# the rollout check (their recorded times, e.g. SFT's time_s, are then of a shared machine).
ALL_CORES = os.cpu_count() or 1
ONE_THREAD = 1

# Every job reads the experiment YAML from $ISOEXEC_EXPERIMENT: its path is no job parameter, so the same
# settings under another path (a moved or copied YAML) rerun nothing; changed settings rerun what reads
# them through each rule's settings digest, and a name whose record has other settings is refused above.
os.environ.update(ISOEXEC_EXPERIMENT=CONFIGFILE)

# Every job allocates through tcmalloc where it is installed (vLLM's CPU setup; isoexec/allocator.py
# says why): a preload acts when a process starts, so it is set here, once, for all jobs.
os.environ.update(with_tcmalloc(dict(os.environ)))

# The commands (isoexec, and python for papermill/nbconvert) come from the environment snakemake
# runs in: put its bin folder first on PATH unless an `isoexec` is already there.
if shutil.which("isoexec") is None:
    os.environ.update(
        PATH=os.pathsep.join(
            [os.path.dirname(sys.executable), os.environ.get("PATH", "")]
        )
    )


wildcard_constraints:
    mode="|".join(CFG.rl.modes),
    seed=r"\d+",


onstart:
    # a device this machine lacks stops the run before any job (its jobs would delete committed outputs
    # first); a dry run (no onstart) may still plan a GPU experiment anywhere
    try:
        check_device(CFG, CONFIGFILE)
    except ValueError as e:
        refuse(e)
