"""Parallel degrees under which each kernel set is proven to give the same bits (the contract's topology
claim). Torch-free, so that the experiment config can refuse a layout outside them at load
(:mod:`isoexec.config`); :mod:`isoexec.kernels.registry` attaches them to the kernel sets.
"""

SINGLE_RANK = {"tp": (1,), "ep": (1,), "sp": (1,)}
"""Topology of a set without parallel invariance: one rank in every dimension."""

ISOEXEC_CPU_TOPOLOGY = {"tp": (1, 2, 4), "ep": (1, 2), "sp": (1, 2, 4), "dp": (1, 2)}
"""Degrees under which the CPU isoexec set is proven invariant: the Megatron trainer's layouts in
``tests/test_trainer_megatron.py`` (TP 1/2/4 with SP, EP 2 with two data-parallel replicas, TP 2 x EP 2)
against the unified model. The pik tree itself allows every power of two dividing ``leaves``."""


ISOEXEC_SM90_TOPOLOGY = {"tp": (1, 2), "ep": (1, 2), "sp": (1, 2), "dp": (1, 2)}
"""Degrees under which the Triton isoexec set is proven invariant: the Megatron trainer on two H200s over
NCCL (TP 1/2 with SP, EP 2) against the unified model's engine path, ``isoexec.bench.megatron_gpu``
(``results/h200x2/megatron.csv``). The pik tree itself allows every power of two dividing ``leaves``
(``results/h200x2/pik.csv`` checks 4 and 8 shards of one GEMM)."""


def proven_topology(mode: str, device: str) -> dict[str, tuple[int, ...]]:
    """The degrees of ``mode``'s kernel set on ``device`` (``isoexec`` on CPU: :data:`ISOEXEC_CPU_TOPOLOGY`,
    on CUDA: :data:`ISOEXEC_SM90_TOPOLOGY`; every other set: :data:`SINGLE_RANK`). A dimension not named
    allows degree 1 only."""
    if mode != "isoexec":
        return dict(SINGLE_RANK)
    return dict(ISOEXEC_CPU_TOPOLOGY if device == "cpu" else ISOEXEC_SM90_TOPOLOGY)
