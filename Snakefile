"""IsoExec reproduction workflow (docs/design.md, The experiments): model, gates, rollout check, paired RL, report.

    snakemake reproduce                                               # experiments/cpu-tiny.yaml end to end
    snakemake reproduce --config experiment=experiments/ci-tiny.yaml  # another experiment
    snakemake -n reproduce                                            # what would run (dry run)
    snakemake kernel_bench                                            # benchmarks, into runs/<exp>/bench
    snakemake --report results/<exp>/report.html                      # one HTML report of the outputs

The default workflow profile (profiles/default, picked up by snakemake itself) uses every core and
prints the shell commands; each job's own output (tqdm/rich progress) goes to logs/<exp>/, e.g.
`tail -f logs/cpu-tiny/rl/native/seed0.log`. Models and checkpoints go under runs/<exp>/ (not
committed); results/<exp>/ holds the small files: contract, gates, metrics, tables, figures, notebook,
and experiment.json, the settings they were made with: a config whose name has a record with other
settings is refused before any job (give it a new name, or delete results/<name>/).
"""


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/settings.smk"
include: "workflow/rules/model.smk"
include: "workflow/rules/gates.smk"
include: "workflow/rules/engine.smk"
include: "workflow/rules/rl.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/bench.smk"
include: "workflow/rules/skyrl.smk"


rule reproduce:
    """The default experiment end to end: gates and paired RL runs (docs/design.md, The experiments)."""
    default_target: True
    input:
        SETTINGS,
        f"{RES}/contract.json",
        f"{RES}/gates.csv",
        f"{RES}/rollout_check.json",
        RL_METRICS,
        TABLES,
        FIGURES,
        f"{RES}/notebooks/analysis.ipynb",
        f"{RES}/notebooks/analysis.html",
