# Report: summary tables, figures, and the executed analysis notebook (with an HTML export).


rule report_tables:
    """main.{csv,md,tex} (the compact table), summary.* (one row per arm, every column), per_seed.*,
    timing.* (per arm and phase, with spreads and intervals), comparison.md, with provenance; with reruns of
    the RL stage committed under results/<exp>/reruns/ (made by hand, not by this workflow) also reruns.* and
    the main table's further-run column. Reruns are not inputs: adding one does not make this rule run again
    (run `isoexec report tables --exp-dir results/<exp>`).
    """
    input:
        RL_METRICS,
    output:
        csv=report(
            f"{RES}/tables/summary.csv",
            caption="../report/summary.rst",
            category="Tables",
        ),
        md=f"{RES}/tables/summary.md",
        tex=f"{RES}/tables/summary.tex",
        provenance=f"{RES}/tables/summary.provenance.json",
        per_seed=report(
            f"{RES}/tables/per_seed.csv",
            caption="../report/per_seed.rst",
            category="Tables",
        ),
        comparison=f"{RES}/tables/comparison.md",
        main=expand(f"{RES}/tables/main.{{ext}}", ext=("csv", "md", "tex")),
        timing=expand(f"{RES}/tables/timing.{{ext}}", ext=("csv", "md", "tex")),
    log:
        f"{LOGS}/report_tables.log",
    conda:
        "../envs/isoexec.yaml"
    params:
        exp_dir=lambda wildcards, output: os.path.dirname(os.path.dirname(output.csv)),
        runs=run_selection(),
    shell:
        "isoexec report tables --exp-dir {params.exp_dir} {params.runs} > {log} 2>&1"


rule report_figures:
    """logprob_diff, is_ratio, reward and time figures, PNG and PDF."""
    input:
        RL_METRICS,
    output:
        logprob_diff=report(
            f"{RES}/figures/logprob_diff.png",
            caption="../report/logprob_diff.rst",
            category="Figures",
        ),
        is_ratio=report(
            f"{RES}/figures/is_ratio.png",
            caption="../report/is_ratio.rst",
            category="Figures",
        ),
        reward=report(
            f"{RES}/figures/reward.png",
            caption="../report/reward.rst",
            category="Figures",
        ),
        time=report(
            f"{RES}/figures/time.png", caption="../report/time.rst", category="Figures"
        ),
        pdf=expand(
            f"{RES}/figures/{{name}}.pdf",
            name=("logprob_diff", "is_ratio", "reward", "time"),
        ),
    log:
        f"{LOGS}/report_figures.log",
    conda:
        "../envs/isoexec.yaml"
    params:
        exp_dir=lambda wildcards, output: os.path.dirname(os.path.dirname(output.time)),
        runs=run_selection(),
    shell:
        "isoexec report figures --exp-dir {params.exp_dir} {params.runs} > {log} 2>&1"


rule notebook:
    """notebooks/analysis.ipynb executed with papermill for this experiment, exported to HTML; no
    run-to-run timestamps or random ids, so unchanged results give unchanged files."""
    input:
        notebook=NOTEBOOK,
        tables=TABLES,
        figures=FIGURES,
        gates=f"{RES}/gates.csv",
        rollout_check=f"{RES}/rollout_check.json",
        sft=f"{RES}/sft_metrics.json",
        settings=SETTINGS,
    output:
        ipynb=f"{RES}/notebooks/analysis.ipynb",
        html=report(
            f"{RES}/notebooks/analysis.html",
            caption="../report/notebook.rst",
            category="Notebook",
        ),
    log:
        f"{LOGS}/notebook.log",
    conda:
        "../envs/isoexec.yaml"
    params:
        python=sys.executable,
        exp_dir=lambda wildcards, input: os.path.dirname(input.gates),
        out_dir=lambda wildcards, output: os.path.dirname(output.html),
    shell:
        "{params.python} -m ipykernel install --sys-prefix --name python3 > {log} 2>&1"
        " && isoexec report notebook --exp-dir {params.exp_dir} --notebook {input.notebook}"
        " --out-dir {params.out_dir} >> {log} 2>&1"
