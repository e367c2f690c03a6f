"""Sequence parallelism: the scan's monoid across the ranks of a torch.distributed process group.

Rank r holds the time slice T_r (rank 0 the earliest). It scans its slice from a zero state, sends
one aggregate per lane, the transition product P_r = A_last ... A_first (k x k) and the end state
Q_r (k x v), in ONE all-gather, and folds the earlier ranks' aggregates into its carry-in:
c_1 = rank 0's end state (rank 0 starts from h0), c_{r+1} = P_r c_r + Q_r. The backward is the
mirror image: each rank sends the gradient D_r of its carry-in, and folds the later ranks' ones in
reverse, E_r = D_{r+1} + P_{r+1}^T E_{r+1}; E_r is the gradient on its last state from later ranks.
Nothing sent grows with T: see payload_bytes.

Rank 0 scans once, from h0. On the others, fix-up, not rerun, for the diagonal ops:
h_t = h^0_t + (a_1 ... a_t) c costs a cumulative product of one number per lane and step and makes
D_r a weighted sum instead of a second backward scan. Rerun for the matrix ops: their prefix
products would be k x k per step, so the local scan runs again with h0 = carry (the kernel's fused
start state) and nothing larger than the states is kept. Every rank needs a slice of >= 1 step.
"""
import contextlib
import functools
import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mingru import dispatch, ops, scans

META_LEN = 20  # int64 slots of the per-call metadata each rank sends before the aggregates


def _acc_dtype(dtype):
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _Diagonal:
    """linear_recurrence(a, b, h0): fix-up with the cumulative product of a."""
    op = staticmethod(ops.linear_recurrence)

    def inputs(self, args):
        return args[:2]

    def zero_part(self, args):
        a, b, _ = args
        return self.op(a, b, None), torch.cumprod(a.to(_acc_dtype(a.dtype)), 1)

    def aggregate(self, args, part):
        zero, prefix = part
        return prefix[:, -1], zero[:, -1]

    def finish(self, args, part, carry):
        zero, prefix = part
        return (zero + prefix * carry.unsqueeze(1)).to(zero.dtype)

    def apply(self, P, c):
        return P * c

    def apply_t(self, P, e):
        return P * e


class _Log(_Diagonal):
    """parallel_scan_log(log_coeffs, log_values): fix-up in log space; the carry is a linear state.

    P_r is kept as a log, so the fold multiplies through exp(log P + log c) and never forms a product
    that under- or overflows on its own.
    """
    op = staticmethod(ops.parallel_scan_log)

    def inputs(self, args):
        return args

    def zero_part(self, args):
        log_coeffs, log_values = args
        start = torch.full_like(log_values[:, :1], -math.inf)
        zero = self.op(log_coeffs, torch.cat([start, log_values[:, 1:]], 1))
        return zero, torch.cumsum(log_coeffs.to(_acc_dtype(log_coeffs.dtype)), 1)

    def finish(self, args, part, carry):
        zero, log_prefix = part
        return (zero + log_prefix.exp() * carry.unsqueeze(1)).to(zero.dtype)

    def apply(self, log_P, c):
        return torch.where(c > 0, (log_P + c.clamp_min(torch.finfo(c.dtype).tiny).log()).exp(), 0)

    def apply_t(self, log_P, e):
        return log_P.exp() * e


class _Gated(_Log):
    """gated_recurrence(k, cand, h0): _Log's fix-up, with log a = log(1 - sigmoid(k)) = -softplus(k)."""
    op = staticmethod(ops.gated_recurrence)

    def inputs(self, args):
        return args[:2]

    def zero_part(self, args):
        k, cand, _ = args
        return self.op(k, cand, None), torch.cumsum(-F.softplus(k.to(_acc_dtype(k.dtype))), 1)

    def apply(self, log_P, c):
        return log_P.exp() * c  # a carry of either sign: gated_recurrence takes any h0


class _Matrix:
    """matrix_recurrence(A, X, h0): rerun with h0 = carry; P_r by a pairwise product tree."""
    op = staticmethod(ops.matrix_recurrence)

    def inputs(self, args):
        return args[:-1]

    def transitions(self, args):
        return args[0]

    def zero_part(self, args):
        return None

    def aggregate(self, args, part):
        with torch.no_grad():
            end = self.run(args, None)[:, -1]
            return product(self.transitions(args)), end

    def finish(self, args, part, carry):
        return self.run(args, carry.to(args[0].dtype))

    def run(self, args, h0):
        """The op on this rank's inputs from the initial state h0."""
        return self.op(*self.inputs(args), h0)

    def apply(self, P, c):
        return (P @ c.unsqueeze(-1)).squeeze(-1) if c.dim() < P.dim() else P @ c

    def apply_t(self, P, e):
        return self.apply(P.transpose(-1, -2), e)


class _Rotation(_Matrix):
    """rotation_recurrence(angles, decay, u, h0[, scale]): rerun through the angle-fused op."""
    op = staticmethod(ops.rotation_recurrence)

    def inputs(self, args):
        return args[:3] + args[4:]  # without h0

    def run(self, args, h0):
        return self.op(*args[:3], h0, *args[4:])

    def transitions(self, args):
        acc = _acc_dtype(args[0].dtype)
        return scans.rotation_matrices(*(x.to(acc) for x in args[:2] + args[4:]))


KINDS = {"linear_recurrence": _Diagonal(), "parallel_scan_log": _Log(),
         "matrix_recurrence": _Matrix(), "rotation_recurrence": _Rotation(), "gated_recurrence": _Gated()}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def product(A):
    """A (B,T,...,k,k) -> A_T ... A_1 (B,...,k,k), multiplied pairwise (later @ earlier) in log2 T rounds."""
    A = A.to(_acc_dtype(A.dtype))
    while A.shape[1] > 1:
        if A.shape[1] % 2:
            eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device).expand_as(A[:, :1])
            A = torch.cat([A, eye], 1)
        A = A[:, 1::2] @ A[:, 0::2]
    return A[:, 0]


class Simulated(NamedTuple):
    """A stand-in group for cost models: this process plays `rank` of `world`, and every other rank's
    message is a copy of its own. Nothing is communicated; the arithmetic is a real rank's."""
    rank: int
    world: int


def _rank_world(group):
    if isinstance(group, Simulated):
        return group.rank, group.world
    return dist.get_rank(group), dist.get_world_size(group)


def _gather(x, group):
    """All ranks' copies of x, rank order; the only collective this module calls."""
    if isinstance(group, Simulated):
        return [x] * group.world
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def _carry_shape(name, args):
    """The state at one step: (B,D) for the diagonal ops, (B,n,k,v) or (B,n,k) for the matrix ones."""
    x = args[2] if name == "rotation_recurrence" else args[1]
    return (x.shape[0],) + tuple(x.shape[2:])


def _transition_shape(name, args):
    if name in ("linear_recurrence", "parallel_scan_log", "gated_recurrence"):
        return _carry_shape(name, args)
    k = _carry_shape(name, args)[2]
    return _carry_shape(name, args)[:2] + (k, k)


def payload_bytes(name, *args):
    """Bytes one rank sends per call: {'forward': ..., 'backward': ...}; the world size does not enter.

    forward = 8 * META_LEN + s * (|P| + |state|), backward = s * |state|, where |P| = B*D (diagonal)
    or B*n*k*k, |state| = B*D, B*n*k*v or B*n*k, s = 4 for half-precision inputs (aggregates travel
    in float32), else the element size. T appears nowhere.
    """
    size = torch.empty((), dtype=_acc_dtype(args[0].dtype)).element_size()
    state = math.prod(_carry_shape(name, args))
    return {"forward": 8 * META_LEN + size * (math.prod(_transition_shape(name, args)) + state),
            "backward": size * state}


def _metadata(name, args, grad_on):
    """[op, dtype, needs-grad, T_r, shapes of the scan inputs without T, -1 padding]."""
    dims = [d for x in KINDS[name].inputs(args) for d in (*x.shape[:1], *x.shape[2:])]
    t_len = args[0].shape[1]
    meta = [list(KINDS).index(name), _DTYPES.index(args[0].dtype), int(grad_on), t_len] + dims
    return torch.tensor(meta + [-1] * (META_LEN - len(meta)), dtype=torch.int64, device=args[0].device)


def _check_agree(name, metas):
    fields = [("the op", slice(0, 1)), ("the dtype", slice(1, 2)),
              ("whether gradients are needed", slice(2, 3)), ("the shapes apart from T", slice(4, None))]
    rows = [m.tolist() for m in metas]
    for what, part in fields:
        for rank, row in enumerate(rows):
            if row[part] != rows[0][part]:
                show = {"the op": lambda r: list(KINDS)[r[0]], "the dtype": lambda r: _DTYPES[r[1]]}.get(
                    what, lambda r: [d for d in r[part] if d >= 0])
                raise ValueError(f"sequence_parallel {name}: ranks disagree on {what}: rank 0 has "
                                 f"{show(rows[0])}, rank {rank} has {show(row)}; every rank must call "
                                 "the same op on its own time slice of the same batch")


class _Sharded(torch.autograd.Function):
    """One sequence-parallel call: the local graph is built inside forward and reused by backward."""

    @staticmethod
    def forward(ctx, name, group, grad_on, *args):
        kind, (rank, _) = KINDS[name], _rank_world(group)
        _check_agree(name, _gather(_metadata(name, args, grad_on), group))
        leaves = [None if x is None else x.detach().requires_grad_(grad_on and x.requires_grad) for x in args]
        acc = _acc_dtype(args[0].dtype)
        carry = None
        with torch.set_grad_enabled(grad_on):
            if rank == 0:
                h = kind.op(*leaves)
                P, Q = torch.zeros(_transition_shape(name, args), dtype=acc, device=h.device), h[:, -1]
            else:
                part = kind.zero_part(leaves)
                P, Q = kind.aggregate(leaves, part)
        P, Q = P.detach().to(acc), Q.detach().to(acc)
        flat = _gather(torch.cat([P.reshape(-1), Q.reshape(-1)]), group)
        Ps = [f[:P.numel()].view_as(P) for f in flat]
        if rank > 0:
            carry = flat[0][P.numel():].view_as(Q)
            for s in range(1, rank):
                carry = kind.apply(Ps[s], carry) + flat[s][P.numel():].view_as(Q)
            carry = carry.requires_grad_(grad_on)
            with torch.set_grad_enabled(grad_on):
                h = kind.finish(leaves, part, carry)
        ctx.name, ctx.group, ctx.Ps = name, group, Ps
        ctx.h, ctx.leaves, ctx.carry = h, leaves, carry
        return h.detach()

    @staticmethod
    def backward(ctx, grad_h):
        kind, (rank, world) = KINDS[ctx.name], _rank_world(ctx.group)
        h, carry = ctx.h, ctx.carry
        state = h[:, -1]
        if rank > 0:
            (local,) = torch.autograd.grad(h, carry, grad_h, retain_graph=True)
        else:
            local = torch.zeros(state.shape, dtype=ctx.Ps[0].dtype, device=state.device)
        Ds = _gather(local.detach(), ctx.group)
        later = torch.zeros_like(Ds[0])
        for s in range(world - 1, rank, -1):
            later = Ds[s] + kind.apply_t(ctx.Ps[s], later)
        grad = grad_h.clone()
        grad[:, -1] += later.to(grad.dtype)
        wanted = [x for x in ctx.leaves if x is not None and x.requires_grad] + ([carry] if rank > 0 else [])
        # the local graph lives as long as ctx, so a retained outer graph can run backward again
        grads = iter(torch.autograd.grad(h, wanted, grad, allow_unused=True, retain_graph=True))
        out = [next(grads) if x is not None and x.requires_grad else None for x in ctx.leaves]
        return (None, None, None, *out)


def _route(group, name, *args):
    if name not in KINDS:
        raise RuntimeError(f"sequence_parallel: {name} has no sequence-parallel form; inside the context "
                           f"only the states-only ops run ({', '.join(KINDS)})")
    rank, world = _rank_world(group)
    if rank < 0:
        raise ValueError("sequence_parallel: this process is not a member of `group`; pass a group "
                         "that every rank holding a slice belongs to")
    with _routed(None):  # the local scans below are ordinary calls
        if world == 1:
            return getattr(ops, name)(*args)
        grad_on = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in args)
        return _Sharded.apply(name, group, grad_on, *args)


@contextlib.contextmanager
def _routed(route):
    old, dispatch.sequence_parallel_route = dispatch.sequence_parallel_route, route
    try:
        yield
    finally:
        dispatch.sequence_parallel_route = old


@contextlib.contextmanager
def sequence_parallel(group=None):
    """Inside, every states-only op (and so every mixer) treats its input as this rank's time slice.

    Ranks hold consecutive slices in rank order (any lengths >= 1); h0 is read on rank 0 only, and
    the h0 copies passed on other ranks receive no gradient. Projections stay local; each scan
    call exchanges payload_bytes with the group (gloo for CPU tensors, NCCL for CUDA ones).
    """
    if not isinstance(group, Simulated) and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("sequence_parallel: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group first")
    with _routed(functools.partial(_route, group)):
        yield


def _sharded_op(name):
    def op(*args, group=None):
        with sequence_parallel(group):
            return getattr(ops, name)(*args)
    op.__name__ = name
    op.__doc__ = f"{name} on this rank's time slice, inside sequence_parallel(group)."
    return op


linear_recurrence = _sharded_op("linear_recurrence")
parallel_scan_log = _sharded_op("parallel_scan_log")
gated_recurrence = _sharded_op("gated_recurrence")
matrix_recurrence = _sharded_op("matrix_recurrence")
rotation_recurrence = _sharded_op("rotation_recurrence")


def slices(T, world, weights=None):
    """Consecutive (start, stop) of T steps over `world` ranks, proportional to weights (even if None)."""
    weights = [1] * world if weights is None else list(weights)
    if len(weights) != world or T < world:
        raise ValueError(f"slices: need T >= world = {world} and {world} weights, got T = {T}, "
                         f"{len(weights)} weights")
    total, bounds = sum(weights), [0]
    for i in range(1, world):
        bounds.append(max(bounds[-1] + 1, min(T - (world - i), round(T * sum(weights[:i]) / total))))
    bounds.append(T)
    return list(zip(bounds[:-1], bounds[1:]))
