# Paired RL runs (docs/design.md, The experiments): one job per mode x seed, all from the same SFT checkpoint.
# Each job takes every core, so timed runs never share the machine (the overheads stay honest).


rule rl_train:
    """GRPO/DAPO for rl.steps steps in one mode and seed; per-step metrics and provenance."""
    input:
        init=f"{RUNS}/model/sft",
    output:
        metrics=f"{RES}/rl/{{mode}}/seed{{seed}}/metrics.jsonl",
        provenance=f"{RES}/rl/{{mode}}/seed{{seed}}/provenance.json",
    log:
        f"{LOGS}/rl/{{mode}}/seed{{seed}}.log",
    benchmark:
        f"{BENCH}/rl_{{mode}}_seed{{seed}}.tsv"
    conda:
        "../envs/isoexec.yaml"
    threads: ALL_CORES
    params:
        out=lambda wildcards, output: os.path.dirname(output.metrics),
        settings=settings_digest(
            "device", "model", "kernels", "task", "rl", "trainer", "engine"
        ),
    shell:
        'isoexec rl train --config "$ISOEXEC_EXPERIMENT" --mode {wildcards.mode} --seed {wildcards.seed}'
        " --init {input.init} --out {params.out} > {log} 2>&1"
