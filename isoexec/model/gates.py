"""Bitwise gates: the same tokens' full-vocabulary fp32 logprob rows computed in different cases,
batch compositions and chunkings must be ``torch.equal`` (docs/design.md, The unified model and The experiments).

Every gate runs for each dtype with the ``isoexec`` kernel set and with the ``native`` set; a native
row that differs is the negative control showing the gate can detect a difference.

``isoexec gates --config experiments/cpu-tiny.yaml`` writes ``results/<exp>/contract.json`` and
``results/<exp>/gates.csv`` (columns: gate, case_a, case_b, kernel_set, dtype, bitwise_equal,
max_abs_diff, n_tokens, detail).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import typer

from isoexec.io import csv_text
from isoexec.model.unified import UnifiedModel
from isoexec.settings import CONFIG_OPTION

GATE_COLUMNS = ["gate", "case_a", "case_b", "kernel_set", "dtype", "bitwise_equal", "max_abs_diff", "n_tokens", "detail"]


@dataclass
class GateResult:
    """One cell of the gate matrix."""

    gate: str
    case_a: str
    case_b: str
    kernel_set: str
    dtype: str
    bitwise_equal: bool
    max_abs_diff: float
    n_tokens: int
    detail: str = ""


def compare(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    """(``torch.equal`` on fp32 rows, max |a - b|). Raises ValueError on a shape or dtype mismatch."""
    if a.shape != b.shape or a.dtype != torch.float32 or b.dtype != torch.float32:
        raise ValueError(f"gate compares fp32 rows of equal shape, got {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
    return torch.equal(a, b), float((a - b).abs().max()) if a.numel() else 0.0


def _score(model: UnifiedModel, seqs: list[torch.Tensor], grad: bool = False) -> list[torch.Tensor]:
    ids = torch.cat(seqs)
    cu = torch.tensor([0] + [int(s.numel()) for s in seqs]).cumsum(0)
    out = model.trainer_logprobs(ids, cu, grad=grad).detach()
    return list(out.split([int(s.numel()) for s in seqs]))


def _engine(model: UnifiedModel, seqs: list[torch.Tensor], splits: list[list[int]]) -> list[torch.Tensor]:
    """Run sequences through the engine together: sequence i is fed in pieces of sizes ``splits[i]``
    (a 1 is a decode step); pieces of all sequences advance in lock step, so prefill chunks and decode
    tokens of different sequences share engine steps."""
    caches = [model.new_cache() for _ in seqs]
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    offs = [0] * len(seqs)
    step = 0
    while any(step < len(sp) for sp in splits):
        active = [i for i, sp in enumerate(splits) if step < len(sp)]
        chunks = [seqs[i][offs[i] : offs[i] + splits[i][step]] for i in active]
        res = model.engine_step([caches[i] for i in active], chunks)
        for i, r in zip(active, res):
            outs[i].append(r)
            offs[i] += splits[i][step]
        step += 1
    return [torch.cat(o) for o in outs]


def run_gates(model: UnifiedModel, gates_cfg, chunk_size: int, kernel_set: str, dtype: str) -> list[GateResult]:
    """All gates for one (kernel set, dtype) model.

    Args:
        model: the unified model (already in ``dtype`` with ``kernel_set``).
        gates_cfg: an ``isoexec.config.GatesSection`` (batch sizes, lengths, decode steps, seed).
        chunk_size: the GDN chunk size C (split points around it are exercised).
    """
    rng = random.Random(gates_cfg.seed)
    gen = torch.Generator().manual_seed(gates_cfg.seed)
    vocab = model.config.vocab_size
    C = chunk_size
    mk = lambda n: torch.randint(0, vocab, (n,), generator=gen)  # noqa: E731
    res: list[GateResult] = []

    def add(gate, ca, cb, a, b, detail=""):
        eq, mad = compare(a, b)
        res.append(GateResult(gate, ca, cb, kernel_set, dtype, eq, mad, int(a.shape[0]), detail))

    # 1. the four cases on the same sequences (decode crosses >= 3 chunk boundaries)
    long_len = max(gates_cfg.decode_steps + 8, 3 * C + 9)
    prompt = 8
    seqs = [mk(long_len), mk(rng.randint(gates_cfg.min_len, gates_cfg.max_len))]
    score = _score(model, seqs)
    fwd = _score(model, seqs, grad=True)
    add("trainer_vs_engine", "trainer_fwd", "trainer_score", torch.cat(fwd), torch.cat(score))
    prefill = _engine(model, seqs, [[len(s)] for s in seqs])
    add("trainer_vs_engine", "trainer_score", "engine_prefill", torch.cat(score), torch.cat(prefill))
    dec = _engine(model, seqs, [[prompt] + [1] * (len(s) - prompt) for s in seqs])
    add("decode_chunk_boundaries", "trainer_score", "engine_decode", torch.cat([s[prompt:] for s in score]),
        torch.cat([d[prompt:] for d in dec]), f"decode of {long_len - prompt} tokens crosses {(long_len - 1) // C} chunk boundaries (C={C})")
    add("decode_chunk_boundaries", "engine_prefill", "engine_decode", torch.cat([p[prompt:] for p in prefill]), torch.cat([d[prompt:] for d in dec]))

    # 2. batch composition: alone vs inside batches of mixed lengths, shuffled
    target = mk(rng.randint(gates_cfg.min_len, gates_cfg.max_len))
    alone = _score(model, [target])[0]
    alone_engine = _engine(model, [target], [[4] + [1] * (len(target) - 4)])[0]
    for bs in gates_cfg.batch_sizes:
        others = [mk(rng.randint(gates_cfg.min_len, gates_cfg.max_len)) for _ in range(bs - 1)]
        batch = others + [target]
        order = list(range(bs))
        rng.shuffle(order)
        out = _score(model, [batch[i] for i in order])
        add("batch_composition", "trainer_score[alone]", f"trainer_score[batch={bs},shuffled]", alone, out[order.index(bs - 1)])
        splits = [[4] + [1] * (len(s) - 4) for s in batch]
        eng = _engine(model, [batch[i] for i in order], [splits[i] for i in order])
        add("batch_composition", "engine_decode[alone]", f"engine_decode[batch={bs},shuffled]", alone_engine, eng[order.index(bs - 1)])

    # 2b. continuous batching: the target decodes while other sequences prefill chunks that cross
    #     KV-block and GDN-chunk boundaries in the same engine steps
    others = [mk(3 * C + 7), mk(2 * C + 3)]
    mixed = _engine(model, [target] + others,
                    [[4] + [1] * (len(target) - 4), [1, 1, len(others[0]) - 2], [1, C + 1, len(others[1]) - C - 2]])
    add("batch_composition", "engine_decode[alone]", "engine_decode[with concurrent prefill chunks]", alone_engine, mixed[0])
    add("batch_composition", "trainer_score", "engine_prefill[chunks, concurrent decode]", torch.cat(_score(model, others)),
        torch.cat(mixed[1:]))

    # 3. padded vs packed, micro-batches
    mb_seqs = [mk(rng.randint(gates_cfg.min_len, gates_cfg.max_len)) for _ in range(max(gates_cfg.micro_batch_sizes))]
    packed = _score(model, mb_seqs)
    L = max(len(s) for s in mb_seqs)
    ids = torch.zeros(len(mb_seqs), L, dtype=torch.long)
    mask = torch.zeros(len(mb_seqs), L, dtype=torch.long)
    for i, s in enumerate(mb_seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    padded = model.trainer_logprobs_padded(ids, mask).detach()
    add("padding", "trainer_score[packed]", "trainer_score[padded]", torch.cat(packed),
        torch.cat([padded[i, : len(s)] for i, s in enumerate(mb_seqs)]))
    for mbs in gates_cfg.micro_batch_sizes:
        micro = []
        for j in range(0, len(mb_seqs), mbs):
            micro += _score(model, mb_seqs[j : j + mbs], grad=True)
        add("micro_batch", "trainer_score[one batch]", f"trainer_fwd[micro_batch={mbs}]", torch.cat(packed), torch.cat(micro))

    # 4. chunked prefill split points, then decode
    seq = mk(max(3 * C + 20, 2 * C + 40))
    ref = _score(model, [seq])[0]
    for split in sorted({C - 1, C, C + 1, 17, 2 * C + 5}):
        if split >= len(seq) - 4:
            continue
        pieces = [split, len(seq) - split - 4, 1, 1, 1, 1]
        out = _engine(model, [seq], [pieces])[0]
        add("prefill_split", "trainer_score", f"engine_prefill[split={split}]+decode", ref, out)
    return res


def gates_csv(results: list[GateResult]) -> str:
    """The gate matrix as CSV text (columns :data:`GATE_COLUMNS`, ``max_abs_diff`` as ``%.6e``)."""
    return csv_text([asdict(r) for r in results], GATE_COLUMNS,
                    lambda c, v: f"{v:.6e}" if c == "max_abs_diff" else v)


def gate_matrix(cfg, log=print):
    """Every gate for each dtype in ``cfg.gates.dtypes`` and both kernel sets, on ``cfg.device``.

    Returns (results, contract of the isoexec model in the experiment's dtype). ``log`` gets one line per cell.
    """
    from isoexec.model.build import random_model

    vocab = cfg.model.vocab_size or 256
    results: list[GateResult] = []
    contract = None
    for dtype in cfg.gates.dtypes:
        for ks in ("isoexec", "native"):
            model = random_model(cfg.model, cfg.kernels, ks, vocab_size=vocab, seed=cfg.gates.seed,
                                 dtype=getattr(torch, dtype), device=cfg.device)
            if ks == "isoexec" and dtype == cfg.model.dtype:
                contract = model.contract()
            cells = run_gates(model, cfg.gates, cfg.kernels.chunk_size, ks, dtype)
            for c in cells:
                log(f"{c.kernel_set:8s} {c.dtype:9s} {c.gate:18s} {c.case_a:26s} vs {c.case_b:40s} "
                    f"{'EQUAL' if c.bitwise_equal else 'differ'}  max|d|={c.max_abs_diff:.3e}")
            results += cells
            del model
    return results, contract


def write_gate_outputs(out, results: list[GateResult], contract) -> None:
    """Write ``contract.json``, ``gates.csv`` and ``gates.provenance.json`` into ``out`` (each atomically)."""
    import json

    from isoexec.contract import save
    from isoexec.io import atomic_write_text
    from isoexec.provenance import provenance

    out.mkdir(parents=True, exist_ok=True)
    if contract is not None:
        save(contract, out / "contract.json")
    atomic_write_text(out / "gates.csv", gates_csv(results))
    atomic_write_text(out / "gates.provenance.json", json.dumps(provenance(), indent=2, sort_keys=True) + "\n")


def gates_command(
    config: Path = CONFIG_OPTION,
    out_dir: Path = typer.Option(None, metavar="DIR", help="folder for contract.json, gates.csv and "
                                 "gates.provenance.json (default: runs/<exp>/gates/, not committed; reproduce "
                                 "writes results/<exp>/)"),
    threads: int = typer.Option(1, min=1, help="torch intra-op threads"),
) -> None:
    """Run the bitwise gate matrix of an experiment: writes contract.json, gates.csv and gates.provenance.json.

    Exits 1 when an isoexec cell is not bitwise equal (the contract's tolerance is 0.0).
    """
    from isoexec.config import check_device, load_config

    torch.set_num_threads(threads)
    cfg = load_config(config)
    check_device(cfg, config)
    results, contract = gate_matrix(cfg, typer.echo)
    write_gate_outputs(out_dir or Path("runs") / cfg.name / "gates", results, contract)
    bad = [r for r in results if r.kernel_set == "isoexec" and not r.bitwise_equal]
    controls = [r for r in results if r.kernel_set == "native" and not r.bitwise_equal]
    typer.echo(f"isoexec cells not equal: {len(bad)}; native cells that differ (negative controls): {len(controls)}")
    if bad:
        raise typer.Exit(1)
