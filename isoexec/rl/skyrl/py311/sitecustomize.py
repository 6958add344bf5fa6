"""Compat item 1 in every Python process of a launch of SkyRL's own entry point below Python 3.12
(:func:`isoexec.rl.skyrl.compat.launch_env` puts this folder first on PYTHONPATH): the launched driver, SkyRL's Ray
workers, vLLM's worker processes and SkyRL's router process all import ``skyrl`` before any isoexec code runs."""

from isoexec.rl.skyrl import compat

compat.install()
