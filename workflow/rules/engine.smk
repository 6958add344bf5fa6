# Rollout engine: vLLM with the unified model must reproduce the trainer's logprobs bit for bit.


rule rollout_check:
    """Engine vs trainer logprobs on sampled rollouts, both modes, on the pipeline's initial model."""
    input:
        init=f"{RUNS}/model/init",
    output:
        rollout_check=report(
            f"{RES}/rollout_check.json",
            caption="../report/rollout_check.rst",
            category="Gates",
        ),
    log:
        f"{LOGS}/rollout_check.log",
    benchmark:
        f"{BENCH}/rollout_check.tsv"
    conda:
        "../envs/isoexec.yaml"
    threads: ONE_THREAD
    params:
        settings=settings_digest(
            "device", "model", "kernels", "task", "trainer", "engine"
        ),
    shell:
        'isoexec rollout-check --config "$ISOEXEC_EXPERIMENT" --checkpoint {input.init}'
        " --out {output.rollout_check} > {log} 2>&1"
