"""IsoExec: unified execution for bitwise-identical logprobs between an RL trainer and its rollout engine.

Layers (one folder each): ``contract`` (the execution contract), ``kernels`` (implementations per
region), ``model`` (the unified Qwen3-Next model), ``engines`` (vLLM adapters), ``trainer``,
``rl`` (GRPO/DAPO loop and metrics), ``report`` (tables, figures).
"""

__version__ = "0.1.0"
