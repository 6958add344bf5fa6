# The settings record: the validated config of the experiment, kept beside its results. common.smk
# refuses a config whose name has a record with other settings (isoexec.settings).


rule experiment_settings:
    """results/<exp>/experiment.json: every setting of the experiment, defaults filled in."""
    output:
        SETTINGS,
    log:
        f"{LOGS}/experiment_settings.log",
    conda:
        "../envs/isoexec.yaml"
    params:
        config=CONFIGFILE,
    shell:
        "isoexec config --config {params.config} --out {output} > {log} 2>&1"
