"""Megatron-core as the trainer backend (native and isoexec kernel sets), on CPU with gloo.

- :mod:`~isoexec.trainer.megatron.compat`: every CPU workaround megatron-core 0.16.1 needs, in one place.
- :mod:`~isoexec.trainer.megatron.config`: :class:`Layout` (TP/EP/SP/CP) and the ``TransformerConfig``.
- :mod:`~isoexec.trainer.megatron.spec`: the Qwen3-Next hybrid layer spec keyed by kernel set.
- :mod:`~isoexec.trainer.megatron.gated_attention`: Megatron's gated attention with the output-gate fix under TP.
- :mod:`~isoexec.trainer.megatron.layers`: the ``isoexec`` modules in Megatron's slots.
- :mod:`~isoexec.trainer.megatron.convert`: declarative HF <-> Megatron weight mapping.
- :mod:`~isoexec.trainer.megatron.trainer`: :class:`MegatronTrainer`, one rank of the trainer.
- :mod:`~isoexec.trainer.megatron.launch`: :func:`init_parallel` and a local gloo launcher.

Importing this package does not import Megatron; the submodules do.
"""

from isoexec.trainer.megatron.config import Layout

__all__ = ["Layout"]
