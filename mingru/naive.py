"""Float64 sequential references: one plain loop per op, the ground truth of every test.

Each loop applies h_t = A_t h_{t-1} + B_t one step at a time, exactly as the recurrence is
written, in float64. They are slow on purpose; nothing else in the package calls them.
"""
import torch


def linear_scan_naive(a, b):
    a, b = a.double(), b.double()
    A, Bc = torch.ones_like(a[:, 0]), torch.zeros_like(b[:, 0])
    outs_a, outs_b = [], []
    for t in range(a.shape[1]):
        A, Bc = a[:, t] * A, a[:, t] * Bc + b[:, t]
        outs_a.append(A)
        outs_b.append(Bc)
    return torch.stack(outs_a, 1), torch.stack(outs_b, 1)


def linear_recurrence_naive(a, b, h0=None):
    a, b = a.double(), b.double()
    h = torch.zeros_like(b[:, 0]) if h0 is None else h0.double()
    out = []
    for t in range(a.shape[1]):
        h = a[:, t] * h + b[:, t]
        out.append(h)
    return torch.stack(out, 1)


def parallel_scan_log_naive(log_coeffs, log_values):
    lc, lv = log_coeffs.double(), log_values.double()
    log_h = lv[:, 0]
    out = []
    for t in range(lc.shape[1]):
        log_h = torch.logaddexp(lc[:, t] + log_h, lv[:, t + 1])
        out.append(log_h)
    return torch.stack(out, 1).exp()


def gated_recurrence_naive(k, cand, h0):
    k, cand, h = k.double(), cand.double(), h0.double()
    z = torch.sigmoid(k)
    g = torch.where(cand >= 0, cand + 0.5, torch.sigmoid(cand))
    out = []
    for t in range(k.shape[1]):
        h = (1 - z[:, t]) * h + z[:, t] * g[:, t]
        out.append(h)
    return torch.stack(out, 1)


def signed_recurrence_naive(k, cand, s, h0, coupled=False):
    k, cand, s, h = k.double(), cand.double(), s.double(), h0.double()
    z = torch.sigmoid(k)
    a = torch.tanh(s) * (1 - z) if coupled else torch.tanh(s)
    out = []
    for t in range(k.shape[1]):
        h = a[:, t] * h + z[:, t] * cand[:, t]
        out.append(h)
    return torch.stack(out, 1)


def matrix_affine_scan_naive(A, Bm):
    A, Bm = A.double(), Bm.double()
    k = A.shape[-1]
    Abar = torch.eye(k, dtype=A.dtype, device=A.device).expand_as(A[:, 0])
    Bbar = torch.zeros_like(Bm[:, 0])
    outs_a, outs_b = [], []
    for t in range(A.shape[1]):
        Abar, Bbar = A[:, t] @ Abar, A[:, t] @ Bbar + Bm[:, t]
        outs_a.append(Abar)
        outs_b.append(Bbar)
    return torch.stack(outs_a, 1), torch.stack(outs_b, 1)


def matrix_scan_naive(M, b):
    Abar, Bbar = matrix_affine_scan_naive(M, b.unsqueeze(-1))
    return Abar, Bbar.squeeze(-1)


def matrix_recurrence_naive(A, X, h0=None):
    A, X = A.double(), X.double()
    h = torch.zeros_like(X[:, 0]) if h0 is None else h0.double()
    out = []
    for t in range(A.shape[1]):
        h = A[:, t] @ h + X[:, t]
        out.append(h)
    return torch.stack(out, 1)


def givens_matrices_naive(angles, decay):
    """Dense k x k transitions decay * G_L ... G_1 from brick-wall Givens layers, float64.

    angles (..., L, k//2): layer l rotates the pairs (i, (i+1) % k) for i = l%2, l%2+2, ...
    by angle angles[..., l, i//2]; decay (...) scales the product.
    """
    angles, decay = angles.double(), decay.double()
    L, half = angles.shape[-2], angles.shape[-1]
    k = 2 * half
    M = torch.eye(k, dtype=angles.dtype, device=angles.device).expand(*angles.shape[:-2], k, k)
    for l in range(L):
        M = givens_layer_naive(M, angles[..., l, :], l % 2)
    return decay[..., None, None] * M


def givens_layer_naive(M, theta, parity):
    k = M.shape[-2]
    rows = list(M.unbind(-2))
    for j in range(k // 2):
        p, q = parity + 2 * j, (parity + 2 * j + 1) % k
        c, s = torch.cos(theta[..., j, None]), torch.sin(theta[..., j, None])
        rows[p], rows[q] = c * rows[p] - s * rows[q], s * rows[p] + c * rows[q]
    return torch.stack(rows, -2)


def rotation_recurrence_naive(angles, decay, u, h0=None, scale=None):
    M = givens_matrices_naive(angles, decay)
    if scale is not None:  # M @ diag(1, s, 1, s, ...): the odd columns scaled
        cols = list(M.unbind(-1))
        cols[1::2] = [c * scale.double()[..., None] for c in cols[1::2]]
        M = torch.stack(cols, -1)
    h = matrix_recurrence_naive(M, u.unsqueeze(-1), None if h0 is None else h0.unsqueeze(-1))
    return h.squeeze(-1)
