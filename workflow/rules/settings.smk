# The settings record: the validated config of the experiment, kept beside its results. common.smk
# refuses a config whose name has a record with other settings (isoexec.settings).


rule experiment_settings:
    """results/<exp>/experiment.json: every setting of the experiment, defaults filled in."""
    output:
        SETTINGS,
    log:
        f"{LOGS}/experiment_settings.log",
    params:
        settings=settings_digest(*type(CFG).model_fields),
    run:
        write_record(CFG, output[0])
