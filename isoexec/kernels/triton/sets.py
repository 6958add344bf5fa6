"""CUDA kernel sets: ``IsoExecTriton`` (("isoexec", "cuda"), arch sm90) and ``NativeCUDA``
(("native", "cuda"), the negative control: cuBLAS ``F.linear``, SDPA, fla GDN kernels).

Which region is what in ``IsoExecTriton`` (also recorded in :meth:`IsoExecTriton.composition`):

* Triton kernels: every GEMM (``attn.qkv_proj``, ``attn.out_proj``, ``gdn.in_proj``,
  ``gdn.out_proj``, ``moe.router``, ``moe.experts`` (grouped), ``mlp.shared_expert``, ``lm_head``),
  ``norm.rms``, ``gdn.norm``, ``gdn.l2norm``, ``attn.core``, ``gdn.conv1d``, ``gdn.core`` (CPR:
  chunk prep, state chain, segmented scan) and ``logprob``.
* torch elementwise ops on CUDA (each element computed by the same functor wherever it sits; no
  reduction whose order depends on the shape): ``embed`` (gather), ``attn.rope``, ``attn.gate``,
  ``gdn.gating``, the router softmax (``exp`` + a fixed tree of adds; ``amax`` is exact), the stable
  sort of the top-k, SwiGLU and ``moe.combine`` (routing order, fp32).

Backward (``trainer_fwd``) is not bitwise: each Triton region is wrapped so that its forward is the
Triton result and its gradient comes from a differentiable torch reference (cuBLAS, SDPA-free math,
transformers' chunked torch GDN).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from isoexec.kernels import dense
from isoexec.kernels.primitives import sigmoid, softplus
from isoexec.kernels.sets import KERNEL_SETS, KernelImpl, KernelSet, NativeTorch
from isoexec.kernels.triton import attention as t_attn
from isoexec.kernels.triton import conv as t_conv
from isoexec.kernels.triton import gdn as t_gdn
from isoexec.kernels.triton import gemm as t_gemm
from isoexec.kernels.triton import logprob as t_logprob
from isoexec.kernels.triton import moe as t_moe
from isoexec.kernels.triton import norm as t_norm


class _RefGrad(torch.autograd.Function):
    """Forward: ``fwd(*tensors)`` (bitwise kernel). Backward: autograd through ``ref(*tensors)``."""

    @staticmethod
    def forward(ctx, fwd, ref, *tensors):  # noqa: D102
        ctx.ref = ref
        ctx.save_for_backward(*tensors)
        return fwd(*tensors)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        need = ctx.needs_input_grad[2:]
        ins = [t.detach().requires_grad_(bool(n)) for t, n in zip(ctx.saved_tensors, need)]
        with torch.enable_grad():
            out = ctx.ref(*ins)
        idx = [i for i, n in enumerate(need) if n]
        gs = torch.autograd.grad(out, [ins[i] for i in idx], grad, allow_unused=True)
        res = [None] * len(ins)
        for i, gv in zip(idx, gs):
            res[i] = gv
        return (None, None, *res)


def with_ref_grad(fwd, ref, *tensors):
    """``fwd(*tensors)``; under autograd its gradient is that of ``ref(*tensors)``."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _RefGrad.apply(fwd, ref, *tensors)
    return fwd(*tensors)


def _ref_attention(q, starts, lengths, *kvs):
    outs, row0 = [], 0
    for b, (s, n) in enumerate(zip(starts, lengths)):
        k, v = kvs[2 * b], kvs[2 * b + 1]
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
        qb = q[row0 : row0 + n].float().transpose(0, 1)  # [Hq, n, D]
        kb = k.float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        vb = v.float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        sc = qb @ kb.transpose(1, 2) / math.sqrt(d)
        mask = torch.arange(k.shape[0], device=q.device)[None, :] > (s + torch.arange(n, device=q.device))[:, None]
        sc = sc.masked_fill(mask, float("-inf"))
        outs.append((torch.softmax(sc, -1) @ vb).transpose(0, 1))
        row0 += n
    return torch.cat(outs).to(q.dtype)


def _ref_gdn(lengths, chunk_size, q, k, v, g, beta):
    from isoexec.kernels.gdn.native import torch_references

    torch_chunk_gated_delta_rule = torch_references()[0]

    outs, row0 = [], 0
    for n in lengths:
        sl = slice(row0, row0 + n)
        o, _ = torch_chunk_gated_delta_rule(q[sl][None], k[sl][None], v[sl][None], g=g[sl][None], beta=beta[sl][None],
                                            chunk_size=chunk_size)
        outs.append(o[0].float())
        row0 += n
    return torch.cat(outs)


class IsoExecTriton(KernelSet):
    """Batch- and mode-invariant CUDA kernels for Hopper (sm90), Triton."""

    name = "isoexec"
    arch = "sm90"
    version = "1"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.chunk_size < 16 or self.chunk_size & (self.chunk_size - 1):
            raise ValueError(f"the Triton CPR kernels need a power-of-two chunk_size >= 16, got {self.chunk_size}")
        if self.kv_block < 16 or self.kv_block & (self.kv_block - 1):
            raise ValueError(f"the Triton attention needs a power-of-two kv_block >= 16, got {self.kv_block}")

    def linear(self, x, w, out_dtype=None):
        od = out_dtype or x.dtype

        def ref(a, b):  # cuBLAS, for the gradient only
            if od == torch.float32:
                return F.linear(a.float(), b.float())
            return F.linear(a, b.to(a.dtype)).to(od)

        return with_ref_grad(lambda a, b: t_gemm.linear(a, b, od), ref, x, w)

    def rms_norm(self, x, w, eps):
        return with_ref_grad(lambda a, b: t_norm.rms_norm(a, b, eps), lambda a, b: dense.native_rms_norm(a, b, eps), x, w)

    def gated_rms_norm(self, x, z, w, eps):
        return with_ref_grad(lambda a, c, b: t_norm.gated_rms_norm(a, c, b, eps),
                             lambda a, c, b: dense.native_gated_rms_norm(a, c, b, eps), x, z, w)

    def l2norm(self, x):
        return with_ref_grad(lambda a: t_norm.l2norm(a), lambda a: dense.native_l2norm(a), x)

    def sigmoid_gate(self, x, gate):
        return dense.iso_sigmoid_gate(x, gate)  # torch elementwise

    def conv1d(self, x, w, prefix):
        y = with_ref_grad(lambda a, b, p: t_conv.causal_conv1d(a, b, p)[0],
                          lambda a, b, p: dense.native_causal_conv1d(a, b, p)[0], x, w, prefix)
        kc = w.shape[1]
        new_prefix = torch.cat([prefix.to(x.dtype), x.detach()])[-(kc - 1):] if kc > 1 else prefix
        return y, new_prefix

    def gdn_gating(self, a, b, A_log, dt_bias):
        beta = sigmoid(b.float()).to(b.dtype).float()
        g = -torch.exp(A_log.float()) * softplus(a.float() + dt_bias.float())
        return g, beta

    def attention(self, q, kv, starts, lengths):
        flat = [t for pair in kv for t in pair]
        return with_ref_grad(
            lambda qq, *f: t_attn.attention(qq, list(zip(f[0::2], f[1::2])), starts, lengths, self.kv_block),
            lambda qq, *f: _ref_attention(qq, starts, lengths, *f), q, *flat)

    def gdn(self, q, k, v, g, beta, lengths, states, grad):
        if grad:
            if any(s is not None for s in states):
                raise ValueError("trainer_fwd (grad=True) GDN starts from empty states")
            o = with_ref_grad(
                lambda *t: t_gdn.cpr_gdn(*t, lengths, [None] * len(lengths), self.chunk_size, keep_state=False)[0],
                lambda *t: _ref_gdn(lengths, self.chunk_size, *t), q, k, v, g, beta)
            return o, [None] * len(lengths)
        return t_gdn.cpr_gdn(q, k, v, g, beta, lengths, states, self.chunk_size, keep_state=True)

    def moe(self, x, router_w, experts, shared, shared_gate_w, top_k, norm_topk_prob):
        flat = [t for e in experts for t in e]
        ne = len(experts)

        def unpack(f):
            return [tuple(f[3 * i : 3 * i + 3]) for i in range(ne)], tuple(f[3 * ne : 3 * ne + 3]), f[3 * ne + 3]

        def fwd(xx, rw, *f):
            ex, sh, sg = unpack(f)
            return t_moe.moe(xx, rw, ex, sh, sg, top_k, norm_topk_prob)

        def ref(xx, rw, *f):
            ex, sh, sg = unpack(f)
            return t_moe.moe_reference(xx, rw, ex, sh, sg, top_k, norm_topk_prob)

        return with_ref_grad(fwd, ref, x, router_w, *flat, *shared, shared_gate_w)

    def logprob(self, logits):
        t = self.temperature
        return with_ref_grad(lambda z: t_logprob.logprob(z, t, self.vocab_block),
                             lambda z: torch.log_softmax(z.float() / t, dim=-1), logits)

    def composition(self, dtype):
        bd = str(dtype).replace("torch.", "")
        bm, bn, bk, nw, ns, prec = t_gemm.tiles_for(dtype)
        gemm = {"acc_dtype": "float32", "boundary_dtype": bd, "tile_m": bm, "tile_n": bn, "tile_k": bk,
                "num_warps": nw, "num_stages": ns, "dot_precision": prec, "split_k": 1, "k_order": "ascending",
                "autotune": False}
        row = {"reduction": "tl.sum_fixed_tile", "acc_dtype": "float32", "tile": "function_of_D_only"}
        ew = {"impl": "torch_elementwise_cuda", "math_dtype": "float32"}
        impl = lambda region, iid, consts, proof: KernelImpl(region, iid, self.version, self.arch, consts, proof)  # noqa: E731
        return [
            impl("embed", "isoexec.torch.embedding_gather", {"dtype": bd, "impl": "torch_elementwise_cuda"}, "gates:trainer_vs_engine"),
            impl("norm.rms", "isoexec.triton.rms_norm", {**row, "scale": "one_plus_w"}, "gates:batch_composition"),
            *[impl(r, "isoexec.triton.gemm", gemm, "tests/test_kernels_triton.py")
              for r in ("attn.qkv_proj", "attn.out_proj", "gdn.in_proj", "gdn.out_proj")],
            impl("attn.rope", "isoexec.torch.rope_elementwise", {**ew, "table_dtype": bd}, "gates:trainer_vs_engine"),
            impl("attn.core", "isoexec.triton.blockwise_online_softmax",
                 {"kv_block": self.kv_block, "tile_m": t_attn.ATTN_BM, "acc_dtype": "float32", "block_order": "ascending",
                  "p_dtype": bd, "split_kv": 1}, "gates:prefill_split"),
            impl("attn.gate", "isoexec.torch.sigmoid_gate", ew, "gates:trainer_vs_engine"),
            impl("gdn.conv1d", "isoexec.triton.causal_conv1d",
                 {"order": "tap_ascending", "acc_dtype": "float32", "tile_t": t_conv.CONV_BT, "tile_c": t_conv.CONV_BC},
                 "gates:prefill_split"),
            impl("gdn.gating", "isoexec.torch.gdn_gating", ew, "gates:trainer_vs_engine"),
            impl("gdn.l2norm", "isoexec.triton.l2norm", {**row, "eps": 1e-6}, "gates:trainer_vs_engine"),
            impl("gdn.core", "isoexec.triton.cpr_gated_delta_rule",
                 {"chunk_size": self.chunk_size, "state_dtype": "float32", "state_pass": "wy_ut_forward_subst_chain",
                  "state_pass_dot_precision": t_gdn.DOT_PRECISION, "chain_tile_v": t_gdn.CHAIN_BV,
                  "in_chunk": "recurrent", "scan_tile_v": t_gdn.SCAN_BV, "scan_num_warps": t_gdn.SCAN_WARPS,
                  "decode_resync": True}, "gates:decode_chunk_boundaries"),
            impl("gdn.norm", "isoexec.triton.gated_rms_norm", row, "gates:trainer_vs_engine"),
            impl("moe.router", "isoexec.triton.gemm+torch_softmax_tree_stable_sort", {**gemm, "ties": "lower_id"},
                 "gates:batch_composition"),
            impl("moe.experts", "isoexec.triton.grouped_gemm_swiglu", gemm, "gates:batch_composition"),
            impl("moe.combine", "isoexec.torch.routing_order_sum", {"acc_dtype": "float32", "order": "routing_rank"},
                 "gates:batch_composition"),
            impl("mlp.shared_expert", "isoexec.triton.gemm_swiglu_sigmoid_gate", gemm, "gates:batch_composition"),
            impl("lm_head", "isoexec.triton.gemm", {**gemm, "out_dtype": "float32"}, "gates:trainer_vs_engine"),
            impl("logprob", "isoexec.triton.online_blocked_log_softmax",
                 {"vocab_block": self.vocab_block, "temperature": self.temperature, "logits_dtype": "float32",
                  "block_order": "ascending"}, "gates:trainer_vs_engine"),
        ]


# ---------------------------------------------------------------------------------------- native
def fla_gdn(q, k, v, g, beta, lengths, states):
    """fla GDN as the native stacks run it: ``fused_recurrent_gated_delta_rule`` for one-token decode
    steps from a state, ``chunk_gated_delta_rule`` (varlen) for everything else.

    q, k ``[N, H, Dk]`` (l2-normalised), v ``[N, H, Dv]``, g / beta ``[N, H]``; states per piece
    ``[H, Dk, Dv]`` fp32 or None. Returns (o ``[N, H, Dv]`` fp32, new states)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    N, H, Dk = k.shape
    Dv = v.shape[-1]
    dev = q.device
    o = torch.empty((N, H, Dv), device=dev, dtype=torch.float32)
    new_states = [None] * len(lengths)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    dec = [i for i, (n, s) in enumerate(zip(lengths, states)) if n == 1 and s is not None]
    seq = [i for i in range(len(lengths)) if i not in set(dec)]
    if dec:
        rows = torch.tensor([starts[i] for i in dec], device=dev)
        h0 = torch.stack([states[i] for i in dec])
        od, hd = fused_recurrent_gated_delta_rule(q[rows][:, None], k[rows][:, None], v[rows][:, None], g=g[rows][:, None],
                                                  beta=beta[rows][:, None], initial_state=h0, output_final_state=True)
        o[rows] = od[:, 0].float()
        for j, i in enumerate(dec):
            new_states[i] = hd[j].float()
    if seq:
        rows = torch.cat([torch.arange(starts[i], starts[i + 1], device=dev) for i in seq])
        cu = torch.tensor([0] + [lengths[i] for i in seq], device=dev).cumsum(0)
        h0 = torch.stack([states[i] if states[i] is not None else torch.zeros(H, Dk, Dv, device=dev) for i in seq])
        oc, hc = chunk_gated_delta_rule(q[rows][None], k[rows][None], v[rows][None], g=g[rows][None], beta=beta[rows][None],
                                        initial_state=h0.float(), output_final_state=True, cu_seqlens=cu)
        o[rows] = oc[0].float()
        for j, i in enumerate(seq):
            new_states[i] = hc[j].float()
    return o, new_states


class NativeCUDA(NativeTorch):
    """Stock CUDA kernels (the negative control): cuBLAS ``F.linear``, SDPA per sequence, fla GDN."""

    name = "native"
    arch = "sm90"
    version = f"torch-{torch.__version__}"

    def attention(self, q, kv, starts, lengths):
        outs, row0 = [], 0
        for (k, v), start, n in zip(kv, starts, lengths):
            qb = q[row0 : row0 + n].transpose(0, 1).unsqueeze(0)
            kb = k.to(q.dtype).transpose(0, 1).unsqueeze(0)
            vb = v.to(q.dtype).transpose(0, 1).unsqueeze(0)
            if n == 1:
                ob = F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True)
            elif start == 0:
                ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
            else:
                qpos = torch.arange(start, start + n, device=q.device)[:, None]
                mask = torch.arange(k.shape[0], device=q.device)[None, :] <= qpos
                ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, enable_gqa=True)
            outs.append(ob[0].transpose(0, 1))
            row0 += n
        return torch.cat(outs, dim=0) if outs else q.new_zeros(q.shape)

    def gdn(self, q, k, v, g, beta, lengths, states, grad):
        if grad:
            o = with_ref_grad(lambda *t: fla_gdn(*t, lengths, [None] * len(lengths))[0],
                              lambda *t: _ref_gdn(lengths, self.chunk_size, *t), q, k, v, g, beta)
            return o, [None] * len(lengths)
        return fla_gdn(q, k, v, g, beta, lengths, states)

    def composition(self, dtype):
        bd = str(dtype).replace("torch.", "")
        impl_of = {"attn.core": "native.torch.sdpa", "gdn.core": "native.fla.chunk+fused_recurrent"}
        for r in ("attn.qkv_proj", "attn.out_proj", "gdn.in_proj", "gdn.out_proj", "lm_head"):
            impl_of[r] = "native.cublas.f_linear"
        return [
            KernelImpl(r, impl_of.get(r, f"native.torch.{r}"), self.version, self.arch, {"dtype": bd}, "none")
            for r in ("embed", "norm.rms", "attn.qkv_proj", "attn.rope", "attn.core", "attn.gate", "attn.out_proj",
                      "gdn.in_proj", "gdn.conv1d", "gdn.gating", "gdn.l2norm", "gdn.core", "gdn.norm", "gdn.out_proj",
                      "moe.router", "moe.experts", "moe.combine", "mlp.shared_expert", "lm_head", "logprob")
        ]


KERNEL_SETS[("isoexec", "cuda")] = IsoExecTriton
KERNEL_SETS[("native", "cuda")] = NativeCUDA
