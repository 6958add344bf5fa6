# Model stage: a random-init tiny Qwen3-Next, then SFT on the arithmetic task (the RL start point).


rule init_model:
    """Random-init model from the config's model section (HF checkpoint layout)."""
    output:
        directory(f"{RUNS}/model/init"),
    log:
        f"{LOGS}/init_model.log",
    benchmark:
        f"{BENCH}/init_model.tsv"
    conda:
        "../envs/isoexec.yaml"
    threads: ONE_THREAD
    params:
        settings=settings_digest("device", "model", "kernels", "task"),
    shell:
        'isoexec rl init-model --config "$ISOEXEC_EXPERIMENT" --out {output} > {log} 2>&1'


rule sft:
    """Supervised fine-tuning so that RL starts from a model with nonzero, unsaturated reward."""
    input:
        init=f"{RUNS}/model/init",
    output:
        directory(f"{RUNS}/model/sft"),
    log:
        f"{LOGS}/sft.log",
    benchmark:
        f"{BENCH}/sft.tsv"
    priority: 1  # on the critical path (the RL runs wait for it): started before the gates and rollout check
    conda:
        "../envs/isoexec.yaml"
    threads: ONE_THREAD
    params:
        settings=settings_digest("device", "model", "kernels", "task", "sft"),
    shell:
        'isoexec rl sft --config "$ISOEXEC_EXPERIMENT" --init {input.init} --out {output} > {log} 2>&1'


rule sft_metrics:
    """The SFT checkpoint's metrics (accuracy, history) copied into the committed results."""
    input:
        f"{RUNS}/model/sft",
    output:
        f"{RES}/sft_metrics.json",
    log:
        f"{LOGS}/sft_metrics.log",
    conda:
        "../envs/isoexec.yaml"
    shell:
        "cp {input}/sft_metrics.json {output} > {log} 2>&1"
