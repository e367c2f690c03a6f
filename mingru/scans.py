"""Eager reference scans: Hillis–Steele doubling over the affine monoid, in pure torch.

Every op is the recurrence h_t = A_t h_{t-1} + B_t. Composing two steps, earlier (A1, B1) then
later (A2, B2), gives (A2 A1, A2 B1 + B2): an associative operation with identity (I, 0). So the
prefix at every t can be built in ceil(log2 T) rounds, each combining position t with t - d.
The log-space op uses the same monoid on (log a, log b) with multiplication turned into addition
and addition into logaddexp. Half-precision inputs are accumulated in float32.
"""
import torch


def hillis_steele(elems, combine):
    """Inclusive scan along dim 1 of a tuple of tensors: result[t] = e[0] ∘ ... ∘ e[t]."""
    T, d = elems[0].shape[1], 1
    while d < T:
        later = tuple(x[:, d:] for x in elems)
        earlier = tuple(x[:, :-d] for x in elems)
        combined = combine(earlier, later)
        elems = tuple(torch.cat([x[:, :d], c], 1) for x, c in zip(elems, combined))
        d *= 2
    return elems


def scalar_combine(earlier, later):
    (a1, b1), (a2, b2) = earlier, later
    return a2 * a1, a2 * b1 + b2


def matrix_combine(earlier, later):
    (A1, B1), (A2, B2) = earlier, later
    return A2 @ A1, A2 @ B1 + B2


def log_combine(earlier, later):
    (a1, s1), (a2, s2) = earlier, later
    return a1 + a2, torch.logaddexp(s1 + a2, s2)


def _acc(x):
    """x in its accumulation dtype: float32 for half-precision inputs (None passes through)."""
    return x.float() if x is not None and x.dtype in (torch.float16, torch.bfloat16) else x


def _upcast(*xs):
    return [_acc(x) for x in xs]


def linear_scan(a, b):
    A, Bc = hillis_steele(_upcast(a, b), scalar_combine)
    return A.to(a.dtype), Bc.to(a.dtype)


def linear_recurrence(a, b, h0=None):
    A, Bc = hillis_steele(_upcast(a, b), scalar_combine)
    h = Bc if h0 is None else A * _acc(h0).unsqueeze(1) + Bc
    return h.to(a.dtype)


def parallel_scan_log(log_coeffs, log_values):
    lc, lv = _upcast(log_coeffs, log_values)
    a_star, s = hillis_steele((lc, lv[:, 1:]), log_combine)
    # h0 joins last, so a log h0 of -inf (h0 = 0) adds no NaN to the gradients.
    log_h = torch.logaddexp(a_star + lv[:, :1], s)
    return log_h.exp().to(log_coeffs.dtype)


def matrix_affine_scan(A, Bm):
    Abar, Bbar = hillis_steele(_upcast(A, Bm), matrix_combine)
    return Abar.to(A.dtype), Bbar.to(A.dtype)


def matrix_scan(M, b):
    Abar, Bbar = matrix_affine_scan(M, b.unsqueeze(-1))
    return Abar, Bbar.squeeze(-1)


def matrix_recurrence(A, X, h0=None):
    Abar, Bbar = hillis_steele(_upcast(A, X), matrix_combine)
    h = Bbar if h0 is None else Abar @ _acc(h0).unsqueeze(1) + Bbar
    return h.to(A.dtype)


def givens_matrices(angles, decay):
    """Dense transitions decay * G_L ... G_1 (..., k, k) from brick-wall Givens layers.

    Layer l rotates the disjoint pairs (i, (i+1) % k), i = l%2, l%2+2, ..., by angles[..., l, i//2]:
    even layers pair (0,1),(2,3)...; odd layers (1,2),...,(k-1,0), a cyclic brick wall.
    """
    L, half = angles.shape[-2], angles.shape[-1]
    k = 2 * half
    M = torch.eye(k, dtype=angles.dtype, device=angles.device).expand(*angles.shape[:-2], k, k)
    for layer in range(L):
        p = torch.arange(layer % 2, k, 2, device=angles.device)
        q = (p + 1) % k
        c, s = angles[..., layer, :].cos().unsqueeze(-1), angles[..., layer, :].sin().unsqueeze(-1)
        Mp, Mq = M[..., p, :], M[..., q, :]
        # p and q together cover every row once, so the empty rows are all overwritten
        M = torch.empty_like(M).index_copy(-2, p, c * Mp - s * Mq).index_copy(-2, q, s * Mp + c * Mq)
    return decay[..., None, None] * M


def rotation_recurrence(angles, decay, u, h0=None):
    M = givens_matrices(*_upcast(angles, decay))
    h = matrix_recurrence(M, _acc(u).unsqueeze(-1), None if h0 is None else _acc(h0).unsqueeze(-1))
    return h.squeeze(-1).to(u.dtype)
