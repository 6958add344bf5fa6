# Kernel benchmarks (docs/design.md, The experiments): not part of `reproduce` (timing needs a quiet machine). Written
# under runs/<exp>/bench/ (not committed); the committed reference results/cpu-tiny/bench/ is replaced
# only on purpose, with `isoexec bench --out-dir results/cpu-tiny/bench`.


rule kernel_bench:
    """Each IsoExec kernel against the native one on the same shapes; the CPR per-layer table."""
    output:
        directory(f"{RUNS}/bench"),
    log:
        f"{LOGS}/kernel_bench.log",
    benchmark:
        f"{RUNS}/benchmarks/kernel_bench.tsv"
    conda:
        "../envs/isoexec.yaml"
    threads: ALL_CORES
    params:
        settings=settings_digest("device", "model", "kernels"),
    shell:
        'isoexec bench --config "$ISOEXEC_EXPERIMENT" --out-dir {output} > {log} 2>&1'
