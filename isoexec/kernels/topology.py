"""Parallel degrees under which each kernel set is proven to give the same bits (the contract's topology
claim). Torch-free, so that the experiment config can refuse a layout outside them at load
(:mod:`isoexec.config`); :mod:`isoexec.kernels.registry` attaches them to the kernel sets.
"""

SINGLE_RANK = {"tp": (1,), "ep": (1,), "sp": (1,)}
"""Topology of a set without parallel invariance: one rank in every dimension."""

ISOEXEC_CPU_TOPOLOGY = {"tp": (1, 2, 4), "ep": (1, 2), "sp": (1, 2, 4), "dp": (1, 2), "cp": (1, 2, 4)}
"""Degrees under which the CPU isoexec set is proven invariant: the Megatron trainer's layouts in
``tests/test_trainer_megatron.py`` (TP 1/2/4 with SP, EP 2 with two data-parallel replicas, TP 2 x EP 2)
and ``tests/test_trainer_megatron_cp.py`` (context parallelism 2 and 4, each with TP 1 and TP 2 + SP)
against the unified model. The pik tree itself allows every power of two dividing ``leaves``."""

ISOEXEC_CPU_CP_WITH = {"tp": (1, 2), "sp": (1, 2), "ep": (1,), "dp": (1,)}
"""The degrees of the other dimensions with which ``cp > 1`` is proven on the CPU set (the CP tests'
layouts); a layout with ``cp > 1`` and another degree outside these is refused."""


ISOEXEC_SM90_TOPOLOGY = {"tp": (1, 2), "ep": (1, 2), "sp": (1, 2), "dp": (1, 2)}
"""Degrees under which the Triton isoexec set is proven invariant: the Megatron trainer on two H200s over
NCCL (TP 1/2 with SP, EP 2) against the unified model's engine path, ``isoexec.bench.megatron_gpu``
(``results/h200x2/megatron.csv``). The pik tree itself allows every power of two dividing ``leaves``
(``results/h200x2/pik.csv`` checks 4 and 8 shards of one GEMM)."""


def topology_problems(mode: str, device: str, degrees: dict[str, int]) -> list[str]:
    """Why the parallel ``degrees`` (``tp``, ``ep``, ``sp``, ``dp``, ``cp``) are outside ``mode``'s proven
    domain on ``device`` (empty: inside), one message per degree, naming the proven degrees: each
    dimension against :func:`proven_topology` (the contract's topology claim), then, under ``cp > 1``,
    the other dimensions against the degrees proven together with context parallelism."""
    domain = proven_topology(mode, device)
    bad = [f"{dim}={d} is outside the {mode} kernel set's proven domain {list(domain.get(dim, (1,)))} "
           "(the contract's topology claim)" for dim, d in degrees.items() if d not in domain.get(dim, (1,))]
    cp = degrees.get("cp", 1)
    if not bad and cp > 1:
        with_cp = ISOEXEC_CPU_CP_WITH if mode == "isoexec" and device == "cpu" else {}
        bad += [f"{dim}={d} with cp={cp} is outside the degrees proven together with context parallelism: "
                f"{dim} in {list(with_cp.get(dim, (1,)))}" for dim, d in degrees.items()
                if dim != "cp" and d not in with_cp.get(dim, (1,))]
    return bad


def proven_topology(mode: str, device: str) -> dict[str, tuple[int, ...]]:
    """The degrees of ``mode``'s kernel set on ``device`` (``isoexec`` on CPU: :data:`ISOEXEC_CPU_TOPOLOGY`,
    on CUDA: :data:`ISOEXEC_SM90_TOPOLOGY`; every other set: :data:`SINGLE_RANK`). A dimension not named
    allows degree 1 only."""
    if mode != "isoexec":
        return dict(SINGLE_RANK)
    return dict(ISOEXEC_CPU_TOPOLOGY if device == "cpu" else ISOEXEC_SM90_TOPOLOGY)
