# GPU-node recipe (docs/design.md, The experiments): the experiment's RL through SkyRL's own entry point
# and SkyRL's vLLM servers; the native arm trains with SkyRL's Megatron worker, the isoexec arm with
# isoexec's policy worker (isoexec.rl.skyrl.recipe) against servers that build the isoexec architecture
# (vLLM plugin entry point vllm.general_plugins: isoexec). Needs an experiment with a skyrl section, e.g.
#   snakemake skyrl_recipe --configfile experiments/qwen35-35b-a3b-8xh100.yaml
# Not part of reproduce; the 8-GPU recipe cannot run on the CPU machines (CUDA, Transformer Engine, 8 GPUs). Its
# isoexec arm at world size 1 (experiments/recipe-ws1.yaml) does, launched by hand with logical GPUs:
#   isoexec rl skyrl-launch --rendered <isoexec.skyrl.yaml> --logical-gpus 2   (docs/integration.md)


rule skyrl_config:
    """SkyRL's overrides for one mode, rendered from the experiment and validated by SkyRL."""
    output:
        f"{RES}/skyrl/{{mode}}.skyrl.yaml",
    log:
        f"{LOGS}/skyrl/config_{{mode}}.log",
    conda:
        "../envs/isoexec.yaml"
    params:
        settings=settings_digest("kernels", "rl", "engine", "skyrl"),
    shell:
        'isoexec rl skyrl-config --config "$ISOEXEC_EXPERIMENT" --mode {wildcards.mode} --out {output} > {log} 2>&1'


rule skyrl_run:
    """One mode of the paired run through SkyRL (SkyRL's console metrics in the log)."""
    input:
        f"{RES}/skyrl/{{mode}}.skyrl.yaml",
    output:
        touch(f"{RES}/skyrl/{{mode}}.done"),
    log:
        f"{LOGS}/skyrl/run_{{mode}}.log",
    benchmark:
        f"{BENCH}/skyrl_{{mode}}.tsv"
    conda:
        "../envs/isoexec.yaml"
    threads: ALL_CORES
    shell:
        "isoexec rl skyrl-launch --rendered {input} > {log} 2>&1"


rule skyrl_recipe:
    """Both modes of the GPU-node recipe, one after the other."""
    input:
        expand(f"{RES}/skyrl/{{mode}}.done", mode=CFG.rl.modes),
