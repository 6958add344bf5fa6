# Gates (docs/design.md, The experiments): the execution contract and the bitwise matrix of regions x case pairs.


rule gates:
    """Contract digest and gate matrix (IsoExec cells bitwise equal, native negative controls)."""
    output:
        contract=report(
            f"{RES}/contract.json", caption="../report/contract.rst", category="Gates"
        ),
        gates=report(
            f"{RES}/gates.csv", caption="../report/gates.rst", category="Gates"
        ),
    log:
        f"{LOGS}/gates.log",
    benchmark:
        f"{BENCH}/gates.tsv"
    conda:
        "../envs/isoexec.yaml"
    threads: ONE_THREAD
    params:
        out_dir=lambda wildcards, output: os.path.dirname(output.gates),
        settings=settings_digest("device", "model", "kernels", "gates"),
    shell:
        'isoexec gates --config "$ISOEXEC_EXPERIMENT" --out-dir {params.out_dir} > {log} 2>&1'
