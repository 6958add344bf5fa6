# Paired RL runs (docs/design.md, The experiments): every arm (the modes and the arms section: isoexec.rl.arms) and seed,
# all from the same SFT checkpoint, in ONE job: `isoexec rl paired` runs the seeds one after the other and,
# within a seed, alternates its arms STEP BY STEP (rl.interleave: step, the default under SkyRL on cpu): step k of
# every arm, then step k+1, in an order turned by one place per seed (seed 0: native isoexec native-tis;
# seed 1: isoexec native-tis native; ...), so that a slow stretch of the machine lands on neighbouring steps
# of every arm and the overheads, paired per step, cancel it (rl.interleave: run runs each arm's whole run
# in turn instead). Each arm keeps its own engine actors and trainer workers across the seeds, all alive at
# once (the start-up is paid once per arm, not per run). The job takes every core, so timed runs never
# share the machine. An interrupted job reruns every run.


rule rl_paired:
    """GRPO/DAPO for rl.steps steps of every arm and seed, the arms of a seed alternating step by step; per-step metrics and provenance."""
    input:
        init=f"{RUNS}/model/sft",
    output:
        metrics=RL_METRICS,
        provenance=[p.replace("metrics.jsonl", "provenance.json") for p in RL_METRICS],
    log:
        f"{LOGS}/rl/paired.log",
    benchmark:
        f"{BENCH}/rl_paired.tsv"
    conda:
        "../envs/isoexec.yaml"
    threads: ALL_CORES
    params:
        out=lambda wildcards, output: os.path.dirname(
            os.path.dirname(os.path.dirname(output.metrics[0]))
        ),
        settings=settings_digest(
            "device", "model", "kernels", "task", "rl", "trainer", "engine", "arms"
        ),
    shell:
        'isoexec rl paired --config "$ISOEXEC_EXPERIMENT" --init {input.init} --out {params.out} > {log} 2>&1'
