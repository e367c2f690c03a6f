"""The public scan ops: check the inputs, then let the dispatch seam pick eager or Triton.

NaN and inf in the inputs are never clamped: the outputs from that step on may be non-finite. The
eager scans follow the recurrence step by step; the Triton kernels combine steps in another order,
where an inf meets a zero state (inf * 0), so an inf there can come out as NaN, and a non-finite
transition at step 0 (whose product Bc does not need) as NaN in Bc too.
An empty sequence (T == 0) has no states: each op returns empty outputs of its documented shapes
(copies of its inputs' empty slices, so autograd still reaches the inputs) and runs no kernel.
"""
from mingru import scans
from mingru.dispatch import dispatch
from mingru.validate import checked as _checked


def _run(name, eager, sizes, empty, *args):
    """dispatch(name, eager, *args); over no steps (sizes["T"] == 0) clones of `empty`, the (empty)
    inputs whose shapes the outputs have, and no kernel runs; with another size 0, the eager scan."""
    if not sizes["T"]:
        copies = tuple(x.clone() for x in empty)
        return copies if len(copies) > 1 else copies[0]
    return dispatch(name, eager, *args, empty=0 in sizes.values())


def linear_scan(a, b):
    """Signed scalar scan. a, b (B,T,D) -> (A, Bc), each (B,T,D), with h_t = A_t h0 + Bc_t."""
    sizes = _checked("linear_scan", [("a", a, ("B", "T", "D")), ("b", b, ("B", "T", "D"))])
    return _run("linear_scan", scans.linear_scan, sizes, (a, b), a, b)


def linear_recurrence(a, b, h0=None):
    """States only: h_t = a_t h_{t-1} + b_t from h0 (B,D) (zeros if None) -> h (B,T,D)."""
    sizes = _checked("linear_recurrence", [("a", a, ("B", "T", "D")), ("b", b, ("B", "T", "D")),
                                           ("h0", h0, ("B", "D"))])
    return _run("linear_recurrence", scans.linear_recurrence, sizes, (b,), a, b, h0)


def parallel_scan_log(log_coeffs, log_values):
    """Log-space scan. log_coeffs (B,T,D), log_values (B,T+1,D) with slot 0 = log h0 -> h (B,T,D).

    h_t = exp(log_coeffs_t) h_{t-1} + exp(log_values_t); h is returned in linear space.
    """
    sizes = _checked("parallel_scan_log", [("log_coeffs", log_coeffs, ("B", "T", "D")),
                                           ("log_values", log_values, ("B", "T+1", "D"))])
    return _run("parallel_scan_log", scans.parallel_scan_log, sizes, (log_coeffs,), log_coeffs, log_values)


def gated_recurrence(k, cand, h0=None):
    """minGRU from its pre-activations: h_t = (1 - z_t) h_{t-1} + z_t g(cand_t), z = sigmoid(k),
    g(x) = x + 1/2 for x >= 0 and sigmoid(x) below. k, cand (B,T,D), h0 (B,D) (zeros if None)
    -> h (B,T,D).

    linear_recurrence on a = 1 - z and b = z g(cand) (for h0 > 0 also parallel_scan_log on their
    logs); the kernel computes the gates from k and cand as it loads them and returns their
    gradients, so no gate tensor is stored.
    """
    sizes = _checked("gated_recurrence", [("k", k, ("B", "T", "D")), ("cand", cand, ("B", "T", "D")),
                                          ("h0", h0, ("B", "D"))])
    if h0 is None:
        h0 = k.new_zeros(k.shape[0], k.shape[2])
    return _run("gated_recurrence", scans.gated_recurrence, sizes, (cand,), k, cand, h0)


def gated_recurrence_stacked(kc, h0=None, bias=None):
    """gated_recurrence on one (B,T,2D) tensor holding k | cand side by side in its last dim (what
    one matmul over the two projections' stacked weights writes), plus bias (2D,) (the two
    projections' biases, stacked the same way; none if None), h0 (B,D) -> h (B,T,D).

    The kernel reads both halves in place, adding the bias as it loads them; its backward writes
    their gradients into one (B,T,2D) tensor and sums the bias's gradient as it goes, so a layer
    runs one matmul forward, one per gradient backward, and no separate bias reduction.
    """
    sizes = _checked("gated_recurrence_stacked", [("kc", kc, ("B", "T", "2D")), ("h0", h0, ("B", "D")),
                                                  ("bias", bias, ("2D",))])
    if sizes["2D"] % 2 or ("D" in sizes and 2 * sizes["D"] != sizes["2D"]):
        raise ValueError(f"gated_recurrence_stacked: kc must have shape (B, T, 2D) (k | cand) and h0 shape "
                         f"(B, D), got kc {tuple(kc.shape)} and h0 {None if h0 is None else tuple(h0.shape)}")
    if h0 is None:
        h0 = kc.new_zeros(kc.shape[0], kc.shape[2] // 2)
    biased = () if bias is None else (bias,)
    return _run("gated_recurrence_stacked", _gated_stacked_eager, sizes, (kc[..., :kc.shape[2] // 2],), kc, h0,
                *biased)


def _gated_stacked_eager(kc, h0, bias=None):
    k, cand = (kc if bias is None else kc + bias).chunk(2, dim=-1)
    return scans.gated_recurrence(k, cand, h0)


def signed_recurrence_stacked(kcs, h0=None, bias=None, coupled=False):
    """SignedMinGRU from its pre-activations k | cand | s, side by side in one (B,T,3D) tensor (what
    one matmul over its three projections' stacked weights writes), plus bias (3D,) (theirs, stacked
    the same way; none if None), h0 (B,D) (zeros if None) -> h (B,T,D):
    h_t = a_t h_{t-1} + z_t cand_t, z = sigmoid(k), a = tanh(s), or with `coupled` (1 - z) tanh(s).

    linear_recurrence on those gates (`scans.signed_gates`); the kernel computes them from the three
    parts as it loads them, adds the bias, and its backward writes their gradients into one (B,T,3D)
    tensor and sums the bias's gradient as it goes: no gate tensor is stored.
    """
    sizes = _checked("signed_recurrence_stacked", [("kcs", kcs, ("B", "T", "3D")), ("h0", h0, ("B", "D")),
                                                   ("bias", bias, ("3D",))])
    if sizes["3D"] % 3 or ("D" in sizes and 3 * sizes["D"] != sizes["3D"]):
        raise ValueError(f"signed_recurrence_stacked: kcs must have shape (B, T, 3D) (k | cand | s) and h0 shape "
                         f"(B, D), got kcs {tuple(kcs.shape)} and h0 {None if h0 is None else tuple(h0.shape)}")
    if not isinstance(coupled, bool):
        raise TypeError(f"signed_recurrence_stacked: coupled must be a bool, got {type(coupled).__name__}")
    if h0 is None:
        h0 = kcs.new_zeros(kcs.shape[0], kcs.shape[2] // 3)
    return _run("signed_recurrence_stacked", _signed_stacked_eager, sizes, (kcs[..., :kcs.shape[2] // 3],), kcs, h0,
                bias, coupled)


def _signed_stacked_eager(kcs, h0, bias, coupled):
    k, cand, s = (kcs if bias is None else kcs + bias).chunk(3, dim=-1)
    return scans.signed_recurrence(k, cand, s, h0, coupled)


def matrix_scan(M, b):
    """2x2 scan. M (B,T,n,2,2), b (B,T,n,2) -> (A (B,T,n,2,2), Bc (B,T,n,2))."""
    sizes = _checked("matrix_scan", [("M", M, ("B", "T", "n", 2, 2)), ("b", b, ("B", "T", "n", 2))])
    return _run("matrix_scan", scans.matrix_scan, sizes, (M, b), M, b)


def matrix_affine_scan(A, Bm):
    """k x k scan. A (B,T,n,k,k), Bm (B,T,n,k,v) -> (Abar (B,T,n,k,k), Bbar (B,T,n,k,v))."""
    sizes = _checked("matrix_affine_scan", [("A", A, ("B", "T", "n", "k", "k")),
                                            ("Bm", Bm, ("B", "T", "n", "k", "v"))])
    return _run("matrix_affine_scan", scans.matrix_affine_scan, sizes, (A, Bm), A, Bm)


def matrix_recurrence(A, X, h0=None):
    """States only: h_t = A_t h_{t-1} + X_t. A (B,T,n,k,k), X (B,T,n,k,v), h0 (B,n,k,v) -> h like X."""
    sizes = _checked("matrix_recurrence", [("A", A, ("B", "T", "n", "k", "k")),
                                           ("X", X, ("B", "T", "n", "k", "v")), ("h0", h0, ("B", "n", "k", "v"))])
    return _run("matrix_recurrence", scans.matrix_recurrence, sizes, (X,), A, X, h0)


def rotation_recurrence(angles, decay, u, h0=None, scale=None):
    """Angle-fused: h_t = decay_t G_t S_t h_{t-1} + u_t, G_t built from Givens angles (see scans.rotation_matrices),
    S_t = diag(1, scale_t, 1, scale_t, ...) (the identity when scale is None).

    angles (B,T,n,L,k/2), decay (B,T,n), u (B,T,n,k), h0 (B,n,k) or None, scale (B,T,n) or None
    -> h (B,T,n,k). With k = 2 and L = 1 the transition is decay_t R(theta_t) diag(1, scale_t).
    """
    sizes = _checked("rotation_recurrence", [("angles", angles, ("B", "T", "n", "L", "half")),
                                             ("decay", decay, ("B", "T", "n")),
                                             ("u", u, ("B", "T", "n", "k")), ("h0", h0, ("B", "n", "k")),
                                             ("scale", scale, ("B", "T", "n"))])
    if not sizes["L"]:
        raise ValueError(f"rotation_recurrence: angles must hold at least one layer of rotations (L >= 1 in "
                         f"(B, T, n, L, k/2)), got shape {tuple(angles.shape)}")
    if sizes["k"] != 2 * sizes["half"]:
        raise ValueError(f"rotation_recurrence: angles must have k/2 = {sizes['k'] // 2} angles per "
                         f"layer for u with k = {sizes['k']}, got {sizes['half']} (shape {tuple(angles.shape)})")
    scaled = () if scale is None else (scale,)
    return _run("rotation_recurrence", scans.rotation_recurrence, sizes, (u,), angles, decay, u, h0, *scaled)
