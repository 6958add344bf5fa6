# Kernel benchmarks (DESIGN.md §5.3): not part of `reproduce` (timing needs a quiet machine).


rule kernel_bench:
    """Each IsoExec kernel against the native one on the same shapes; the CPR per-layer table."""
    output:
        directory(f"{RES}/bench"),
    log:
        f"{LOGS}/kernel_bench.log",
    benchmark:
        f"{BENCH}/kernel_bench.tsv"
    conda:
        "../envs/isoexec.yaml"
    threads: ALL_CORES
    params:
        config=CONFIGFILE,
        settings=settings_digest("device", "model", "kernels"),
    shell:
        "isoexec bench --config {params.config} > {log} 2>&1"
