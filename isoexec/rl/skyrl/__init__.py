"""SkyRL integration (:mod:`~isoexec.rl.skyrl.driver` and its pieces). Importing this package imports
nothing from ``skyrl``; :mod:`~isoexec.rl.skyrl.compat` must run before the first ``skyrl`` import."""


def check_recipe_inputs(exp, mode: str) -> None:
    """What the recipe's render refuses before it imports SkyRL (so that a refusal is its one line, printed before any
    library's import-time message).

    Raises:
        ValueError: the experiment ``exp`` has no ``skyrl`` section, or ``mode`` is not native / isoexec.
    """
    if exp.skyrl is None:
        raise ValueError(f"experiment {exp.name!r} has no skyrl section (model_path, train_data, cluster)")
    if mode not in ("native", "isoexec"):
        raise ValueError(f"mode must be 'native' or 'isoexec', got {mode!r}")
