"""isoexec.contract: the execution contract (docs/design.md, The execution contract).

A declarative, hashable record of every execution choice that can change bits. Both runtimes build
it, compare ``numerical_policy`` digests (:func:`check_handshake`) and refuse to run when they
disagree; at run time :func:`check_topology` and :func:`check_engine_settings` check the claims.

Modules: ``schema`` (frozen dataclasses, constants), ``canonical`` (canonical JSON, floats as bit
patterns), ``identity`` (digests), ``validate`` (all rules, all violations at once), ``handshake``
(diff and runtime checks), ``store`` (atomic save, verifying load), ``cli`` (``isoexec contract``).

Example::

    from isoexec.contract import Claims, CompositionEntry, ExecutionContract, TopologyClaim, save

    c = ExecutionContract.build(
        model={"architecture": "Qwen3NextForCausalLM", "config_sha256": "..."},
        cases=["trainer_score", "engine_prefill", "engine_decode"],
        composition=[CompositionEntry("gdn.core", ("trainer_score", "engine_prefill", "engine_decode"),
                                      impl="isoexec.cpr_gdn.reference", version="1", arch="cpu",
                                      constants={"chunk_size": 64}, proof="tests/test_gdn.py::test_cpr")],
        claims=Claims(topology={"tp": TopologyClaim(domain=(1, 2, 4, 8))},
                      state={"weight_sync": ("prefix_cache", "gdn_state")},
                      tolerances={"logprob_abs_diff": 0.0},
                      engine={"enable_prefix_caching": False}),
        deployment={"gpu_memory_utilization": 0.9},
    )
    save(c, "results/contract.json")
"""

from .canonical import decode, encode
from .errors import (
    ClaimViolation,
    ContractDecodeError,
    ContractError,
    ContractMismatch,
    ContractTampered,
    ContractValidationError,
    Violation,
)
from .handshake import check_engine_settings, check_handshake, check_topology, diff
from .identity import compute_identities, field_digests
from .schema import (
    CASES,
    PARALLEL_DIMS,
    REGIONS,
    SCHEMA,
    STATES,
    Claims,
    CompositionEntry,
    Constant,
    ExecutionContract,
    F32,
    Identities,
    TopologyClaim,
)
from .store import load, loads, save, to_file_bytes
from .validate import validate

__all__ = [
    "CASES",
    "PARALLEL_DIMS",
    "REGIONS",
    "SCHEMA",
    "STATES",
    "Claims",
    "CompositionEntry",
    "Constant",
    "ExecutionContract",
    "F32",
    "Identities",
    "TopologyClaim",
    "ClaimViolation",
    "ContractDecodeError",
    "ContractError",
    "ContractMismatch",
    "ContractTampered",
    "ContractValidationError",
    "Violation",
    "check_engine_settings",
    "check_handshake",
    "check_topology",
    "diff",
    "compute_identities",
    "field_digests",
    "decode",
    "encode",
    "load",
    "loads",
    "save",
    "to_file_bytes",
    "validate",
]
