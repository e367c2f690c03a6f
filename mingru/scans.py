"""Eager reference scans in pure torch: chunked scans over the affine monoid.

Every op is the recurrence h_t = A_t h_{t-1} + B_t. Composing two steps, earlier (A1, B1) then
later (A2, B2), gives (A2 A1, A2 B1 + B2): an associative operation with identity (I, 0).
`chunked_scan` cuts time into chunks of CHUNK steps, walks every chunk step by step (all chunks
at once, CHUNK - 1 dependent combines), scans the chunk totals by Hillis–Steele doubling, and
composes each chunk with the total of everything before it. The log-space op uses the same monoid
on (log a, log b), with multiplication turned into addition and addition into logaddexp; on long
sequences each chunk is one cumsum and one logcumsumexp (see parallel_scan_log for its stability
rule). linear_recurrence (states only) runs the same chunked scan in place, outside autograd, with the
adjoint recurrence, one more scan backwards in time, as its backward; so does matrix_recurrence for
k <= SMALL_K (rotation_recurrence's 2 x 2 planes), with elementwise products in place of tiny matmuls.
Half-precision inputs are accumulated in float32.
"""
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

CHUNK = 16
LOG_CHUNK = 16
WALK_MAX_T = 128


def hillis_steele(elems, combine, identity=None):
    """Inclusive scan along dim 1 of a tuple of tensors: result[t] = e[0] ∘ ... ∘ e[t].

    identity: the monoid's identity as one number per tensor (scalar monoids only). A round then
    combines every step with the elements d steps back, shifted in with that identity as padding,
    instead of combining slices and concatenating the first d steps back on: the same values (for
    finite inputs), and for autograd one padded copy per tensor and round instead of slices whose
    backward each fills a full-size tensor.
    """
    T, d = elems[0].shape[1], 1
    while d < T:
        if identity is not None:
            shift = lambda x, v: F.pad(x, [0, 0] * (x.dim() - 2) + [d, -d], value=v)  # noqa: E731
            elems = tuple(combine(tuple(shift(x, v) for x, v in zip(elems, identity)), elems))
        else:
            later = tuple(x[:, d:] for x in elems)
            earlier = tuple(x[:, :-d] for x in elems)
            combined = combine(earlier, later)
            elems = tuple(torch.cat([x[:, :d], c], 1) for x, c in zip(elems, combined))
        d *= 2
    return elems


def _chunks(x, chunk):
    """(B, T, ...) -> (B, N, chunk, ...), zero-padded at the end (later steps never reach earlier ones)."""
    B, T = x.shape[:2]
    N = -(-T // chunk)
    pad = [0, 0] * (x.dim() - 2) + [0, N * chunk - T]
    return F.pad(x, pad).reshape(B, N, chunk, *x.shape[2:])


def _unchunk(x, T):
    return x.flatten(1, 2)[:, :T]


def chunk_prefixes(totals, combine, identity=None):
    """Exclusive scan over chunks: for chunk j >= 1 the composition of chunks 0..j-1, as (B, N-1, 1, ...)."""
    return tuple(p[:, :-1].unsqueeze(2) for p in hillis_steele(totals, combine, identity))


def walk(elems, combine):
    """Inclusive scan along dim 1 of a tuple of tensors by T - 1 dependent combines, each over
    everything else in the batch at once (unbind, not indexing: each index's backward would fill a
    full-size tensor)."""
    steps = [x.unbind(1) for x in elems]
    acc = tuple(x[0] for x in steps)
    out = [acc]
    for later in zip(*(x[1:] for x in steps)):
        acc = combine(acc, later)
        out.append(acc)
    return tuple(torch.stack(x, 1) for x in zip(*out))


def chunked_scan(elems, combine, states_only=False, chunk=CHUNK, identity=None):
    """The same inclusive scan as hillis_steele: every chunk walked step by step, all chunks at once
    (chunk - 1 combines on tensors chunk times shorter than the sequence), the chunk totals scanned
    by hillis_steele, and one composition over the whole sequence.

    states_only: return (None, B) and skip the transition products of the final composition.
    identity: as in hillis_steele.
    """
    T = elems[0].shape[1]
    if T <= chunk:
        return walk(elems, combine)
    parts = [_chunks(x, chunk) for x in elems]
    B, N = parts[0].shape[:2]
    local = walk(tuple(x.flatten(0, 1) for x in parts), combine)
    local = tuple(x.reshape(B, N, *x.shape[1:]) for x in local)
    before = chunk_prefixes(tuple(x[:, :, -1] for x in local), combine, identity)
    rest = combine(before, tuple(x[:, 1:] for x in local), states_only)
    return tuple(None if r is None else _unchunk(torch.cat([x[:, :1], r], 1), T) for x, r in zip(local, rest))


def scalar_combine(earlier, later, states_only=False):
    (a1, b1), (a2, b2) = earlier, later
    return None if states_only else a2 * a1, a2 * b1 + b2


def matrix_combine(earlier, later, states_only=False):
    (A1, B1), (A2, B2) = earlier, later
    return None if states_only else A2 @ A1, A2 @ B1 + B2


def log_combine(earlier, later, states_only=False):
    (a1, s1), (a2, s2) = earlier, later
    return None if states_only else a1 + a2, torch.logaddexp(s1 + a2, s2)


def _acc(x):
    """x in its accumulation dtype: float32 for half-precision inputs (None passes through)."""
    return x.float() if x is not None and x.dtype in (torch.float16, torch.bfloat16) else x


def _upcast(*xs):
    return [_acc(x) for x in xs]


def _fold_h0(first_step, b, h0):
    """b with h0 folded into its first step (b_0 + A_0 h0), so a states-only scan needs no h0 term."""
    return b if h0 is None else torch.cat([first_step(_acc(h0)) + b[:, :1], b[:, 1:]], 1)


SCALAR_IDENTITY = (1.0, 0.0)  # (a, b) of the step h -> h


def linear_scan(a, b):
    A, Bc = chunked_scan(_upcast(a, b), scalar_combine, identity=SCALAR_IDENTITY)
    return A.to(a.dtype), Bc.to(a.dtype)


def _states(a, b, h0=None, chunk=CHUNK, owned=False):
    """linear_recurrence's states from h0 (None: zero), outside autograd, updated in place.

    The same chunked scan as chunked_scan (every chunk walked step by step, all chunks at once; the
    chunk totals scanned by chunk_prefixes; one composition), written into one buffer: b's copy
    (b itself when `owned` and its layout allows). On a CPU a fresh full-size tensor costs about as
    much as a pass over it, so the scan allocates two: the buffer and the chunks' cumulative
    products. With h0 None, a_0 is never read.
    """
    B, T, D = b.shape
    N = -(-T // chunk)
    if owned and N * chunk == T and b.is_contiguous():
        h = b
    else:
        h = b.new_empty(B, N * chunk, D)
        h[:, :T] = b
        h[:, T:] = 0
    if h0 is not None:
        h[:, 0].addcmul_(a[:, 0], h0)
    if N == 1:
        for t in range(1, T):
            h[:, t].addcmul_(a[:, t], h[:, t - 1])
        return h[:, :T]
    hc, ac = h.view(B, N, chunk, D), _chunks(a, chunk)
    for t in range(1, chunk):
        hc[:, :, t].addcmul_(ac[:, :, t], hc[:, :, t - 1])
    products = ac.cumprod(2)
    _, before = chunk_prefixes((products[:, :, -1], hc[:, :, -1]), scalar_combine, SCALAR_IDENTITY)
    hc[:, 1:].addcmul_(products[:, 1:], before)
    return h[:, :T]


def _adjoint_coefficients(a):
    """The adjoint recurrence's coefficients in reversed time: step s (t = T-1-s) takes a_{t+1} =
    a_{T-s} along dim 1 (s >= 1; step 0 holds a_0, which the scan never reads)."""
    T = a.shape[1]
    return a.index_select(1, torch.arange(T, 0, -1, device=a.device) % T)


class _LinearRecurrence(torch.autograd.Function):
    """linear_recurrence's states, with the adjoint recurrence as the backward.

    With g_t = dL/dh_t (everything that reaches h_t), g_t = dh_t + a_{t+1} g_{t+1}: the same
    recurrence, run backwards in time by the same scan. Then db_t = g_t, da_t = g_t h_{t-1} and
    dh0 = a_0 g_0. Autograd records none of the scan's steps: a training step keeps a, h0 and h
    instead of every step's intermediates, and its backward is one scan, not the adjoint of each
    step (on a CPU the per-step bookkeeping and fresh buffers dominate). _SmallMatrixRecurrence is
    the same form for k <= SMALL_K; larger matrix scans keep autograd through chunked_scan, where
    this form, with a batched k x k matmul a step, measured slower.
    """

    @staticmethod
    def forward(ctx, a, b, h0):
        h = _states(a, b, h0)
        ctx.save_for_backward(a, h0, h)
        return h

    @staticmethod
    @once_differentiable
    def backward(ctx, dh):
        a, h0, h = ctx.saved_tensors
        g = _states(_adjoint_coefficients(a), dh.flip(1), owned=True).flip(1)
        da = g.clone()
        da[:, 1:].mul_(h[:, :-1])
        if h0 is None:
            da[:, 0].zero_()
        else:
            da[:, 0].mul_(h0)
        dh0 = a[:, 0] * g[:, 0] if h0 is not None and ctx.needs_input_grad[2] else None
        return da, g, dh0


def linear_recurrence(a, b, h0=None):
    a32, b32, h0 = _upcast(a, b, h0)
    return _LinearRecurrence.apply(a32, b32, h0).to(a.dtype)


def parallel_scan_log(log_coeffs, log_values):
    """Log-space scan; log h0 (slot 0 of log_values) joins last, so log h0 = -inf (h0 = 0) adds no
    NaN to the gradients. Up to WALK_MAX_T steps, or when some log a is -inf (a = 0, outside the
    closed form's domain), it is chunked_scan over log_combine; beyond that, one cumsum and one
    logcumsumexp per chunk of LOG_CHUNK steps replace the CHUNK - 1 steps of each chunk's walk.

    Stability rule: inside a chunk, a*_t = cumsum(log a) restarts at 0, so |a*| <= LOG_CHUNK max|log a|
    and log h_t = a*_t + logcumsumexp(log b - a*)_t loses at most about 2^-24 LOG_CHUNK max|log a| to
    cancellation in float32, however long T is; chunks compose through log_combine, whose terms are
    true logs of partial states and never cancel.
    """
    lc, lv = _upcast(log_coeffs, log_values)
    T = lc.shape[1]
    log_h0 = lv[:, :1]
    # Under torch.compile the walk is always taken: the -inf test reads tensor data (a graph break).
    if T <= WALK_MAX_T or torch.compiler.is_compiling() or torch.isneginf(lc).any():
        a_star, s = chunked_scan((lc, lv[:, 1:]), log_combine)
        return torch.logaddexp(a_star + log_h0, s).exp().to(log_coeffs.dtype)
    a_star = _chunks(lc, LOG_CHUNK).cumsum(2)
    s = a_star + torch.logcumsumexp(_chunks(lv[:, 1:], LOG_CHUNK) - a_star, 2)
    a_before, s_before = chunk_prefixes((a_star[:, :, -1], s[:, :, -1]), log_combine)
    log_h0 = log_h0.unsqueeze(1)
    log_h_in = torch.cat([log_h0, torch.logaddexp(a_before + log_h0, s_before)], 1)  # (B, N, 1, D)
    log_h = torch.logaddexp(a_star + log_h_in, s)
    return _unchunk(log_h, T).exp().to(log_coeffs.dtype)


def g(x):
    """minGRU's positive candidate activation: x + 1/2 for x >= 0, sigmoid(x) below."""
    return torch.where(x >= 0, x + 0.5, torch.sigmoid(x))


def gates(k, cand):
    """minGRU's coefficients from its pre-activations: a = 1 - z, computed as sigmoid(-k) (exact
    where z = sigmoid(k) is near 1, where 1 - z would round to 0), and b = z g(cand)."""
    return torch.sigmoid(-k), torch.sigmoid(k) * g(cand)


def gated_recurrence(k, cand, h0):
    """minGRU from its pre-activations: h_t = (1 - z_t) h_{t-1} + z_t g(cand_t), z = sigmoid(k),
    as the kernel runs it: linear_recurrence on a = 1 - z = sigmoid(-k) and b = z g(cand), gates in
    float32. Linear space is stable here without logs: 0 < a < 1, so every composed coefficient only
    shrinks and every state is a weighted sum of h0 and the g values; and any h0 (negative too) gets
    its exact state and gradient, where log space needs h0 > 0."""
    return linear_recurrence(*gates(*_upcast(k, cand)), h0).to(k.dtype)


def signed_gates(k, cand, s, coupled=False):
    """SignedMinGRU's coefficients from its pre-activations: a = tanh(s) in (-1, 1) (coupled:
    (1 - z) tanh(s), 1 - z computed as sigmoid(-k)) and b = z cand, z = sigmoid(k)."""
    a = torch.tanh(s)
    if coupled:
        a = torch.sigmoid(-k) * a
    return a, torch.sigmoid(k) * cand


def signed_recurrence(k, cand, s, h0, coupled=False):
    """SignedMinGRU from its pre-activations, as the kernel runs it: linear_recurrence on
    signed_gates, gates in float32. |a| < 1, so linear space is stable without logs, and a state
    may take either sign."""
    return linear_recurrence(*signed_gates(*_upcast(k, cand, s), coupled), h0).to(k.dtype)


def matrix_affine_scan(A, Bm):
    Abar, Bbar = chunked_scan(_upcast(A, Bm), matrix_combine)
    return Abar.to(A.dtype), Bbar.to(A.dtype)


def matrix_scan(M, b):
    Abar, Bbar = matrix_affine_scan(M, b.unsqueeze(-1))
    return Abar, Bbar.squeeze(-1)


SMALL_K = 2  # the largest k that matrix_recurrence runs through _SmallMatrixRecurrence (v = 1)


def _small_chunk(T):
    """_small_states' chunk length: about sqrt(T) (a power of two), so the walk inside the chunks and
    the walk across them take about as many steps each, the fewest in all."""
    return max(4, 1 << ((T - 1).bit_length() + 1) // 2)


def _small_states(A, u, h0=None, transposed=False):
    """States of h_t = M_t h_{t-1} + u_t from h0 (None: zero), outside autograd, for k x k blocks
    stored column by column with the blocks last: A (B, T, k, k, n), A[:, t, j, :, m] = column j of
    block m's M_t; u (B, T, k, n); h0 (B, k, n). transposed=True runs the scan on the M_t^T (A read
    row by row). Returns h (B, T, k, n), laid out in memory as (B, T, n, k).

    Every product is k elementwise multiply-adds over all blocks and chunks at once, never a
    batched matmul of tiny matrices. One buffer holds, for each step of each chunk, the
    chunk-relative products P_t = M_t ... M_s (s the chunk's first step) beside the local states
    (its last column), so one walk of chunk - 1 steps (k in-place multiply-adds each) forms both;
    the chunks' start states h_in then follow by a walk across the chunks (h_in <- P_end h_in +
    h_end), and one pass of k multiply-adds adds P_t h_in to every state. A single chunk forms no
    products. Time is padded with M = 0, u = 0 to whole chunks; no returned state reads the padding.
    """
    B, T, k, n = u.shape
    C = min(_small_chunk(T), T)
    N = -(-T // C)
    if transposed:
        A = A.transpose(2, 3)
    if N * C != T:
        A = F.pad(A, [0, 0, 0, 0, 0, 0, 0, N * C - T])
    Ac = A.reshape(B, N, C, k, k, n)                  # a view: only time is split
    cols = k + 1 if N > 1 else 1
    X = u.new_empty(B, N, C, cols, k, n)
    Xt = X.view(B, N * C, cols, k, n)
    Xt[:, :T, -1] = u
    Xt[:, T:, -1] = 0
    if h0 is not None:
        Xt[:, 0, -1] += (A[:, 0] * h0.unsqueeze(2)).sum(1)
    if N > 1:
        X[:, :, 0, :k] = Ac[:, :, 0]
        X[:, :, 1:, :k] = 0
    for t in range(1, C):
        for j in range(k):
            X[:, :, t].addcmul_(Ac[:, :, t, j].unsqueeze(2), X[:, :, t - 1, :, j].unsqueeze(3))
    if N > 1:
        ends = X[:, :, -1]
        h_in = u.new_empty(B, N, k, n)
        h_in[:, 1:] = ends[:, :-1, -1]
        for c in range(1, N - 1):
            for j in range(k):
                h_in[:, c + 1].addcmul_(ends[:, c, j], h_in[:, c, j:j + 1])
        for j in range(k):
            X[:, 1:, :, -1].addcmul_(X[:, 1:, :, j], h_in[:, 1:, None, j:j + 1])
    h = u.new_empty(B, T, n, k).transpose(2, 3)
    h.copy_(Xt[:, :T, -1])
    return h


class _SmallMatrixRecurrence(torch.autograd.Function):
    """_small_states (A (B,T,k,k,n) by columns, u (B,T,k,n), h0 (B,k,n) or None) with the adjoint
    recurrence as the backward, as _LinearRecurrence: g_t = dh_t + M_{t+1}^T g_{t+1}, the same scan
    backwards in time on the transposes, then du_t = g_t, dM_t = g_t h_{t-1}^T, dh0 = M_0^T g_0.
    Autograd records none of the steps; the backward keeps A, h0 and the states."""

    @staticmethod
    def forward(ctx, A, u, h0):
        h = _small_states(A, u, h0)
        ctx.save_for_backward(A, h0, h)
        return h

    @staticmethod
    @once_differentiable
    def backward(ctx, dh):
        A, h0, h = ctx.saved_tensors
        g = _small_states(_adjoint_coefficients(A), dh.flip(1), transposed=True).flip(1)  # on the M^T
        dA = A.new_empty(A.shape)                     # dA[:, t, j, i] = dM_t[i, j] = g_t[i] h_{t-1}[j]
        torch.mul(g[:, 1:, None], h[:, :-1, :, None], out=dA[:, 1:])
        if h0 is None:
            dA[:, 0] = 0
        else:
            torch.mul(g[:, 0, None], h0[:, :, None], out=dA[:, 0])
        dh0 = (A[:, 0] * g[:, 0, None]).sum(2) if h0 is not None and ctx.needs_input_grad[2] else None
        return dA, g, dh0


def _small_matrix_recurrence(A, X, h0):
    """matrix_recurrence for v = 1 through _SmallMatrixRecurrence: A (B,T,n,k,k), X (B,T,n,k,1),
    h0 (B,n,k,1) or None, upcast -> h (B,T,n,k,1)."""
    h = _SmallMatrixRecurrence.apply(A.permute(0, 1, 4, 3, 2), X[..., 0].transpose(2, 3),
                                     None if h0 is None else h0[..., 0].transpose(1, 2))
    return h.transpose(2, 3).unsqueeze(-1)


def matrix_recurrence(A, X, h0=None):
    """States only, h_t = A_t h_{t-1} + X_t. For k <= SMALL_K and v = 1, _SmallMatrixRecurrence
    (elementwise products, the adjoint scan as backward); otherwise chunked_scan under autograd."""
    A32, X32 = _upcast(A, X)
    if A.shape[-1] <= SMALL_K and X.shape[-1] == 1:
        return _small_matrix_recurrence(A32, X32, _acc(h0)).to(A.dtype)
    X32 = _fold_h0(lambda h: A32[:, :1] @ h.unsqueeze(1), X32, h0)
    return chunked_scan((A32, X32), matrix_combine, states_only=True)[1].to(A.dtype)


def unit_lower_solve(L, R):
    """X = (I + L)^{-1} R, reading only the strictly lower part of L (..., M, M); R (..., M, c)."""
    return torch.linalg.solve_triangular(L, R, upper=False, unitriangular=True)


def unit_lower_inverse(L):
    """(I + L)^{-1}, reading only the strictly lower part of L (..., M, M)."""
    eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device).expand(L.shape)
    return torch.linalg.solve_triangular(L, eye, upper=False, unitriangular=True)


def _block_diagonal(blocks):
    """(..., m, 2, 2) blocks -> the (..., 2m, 2m) matrix with them on its diagonal."""
    m = blocks.shape[-3]
    if m == 1:
        return blocks[..., 0, :, :]
    grid = torch.diag_embed(blocks.movedim(-3, -1))  # (..., 2, 2, m, m): block (j, j) holds blocks[j]
    lead = grid.dim() - 4
    return grid.permute(*range(lead), lead + 2, lead, lead + 3, lead + 1).reshape(*blocks.shape[:-3], 2 * m, 2 * m)


def rotation_matrices(angles, decay, scale=None):
    """rotation_recurrence's dense transitions decay * G_L ... G_1 S (..., k, k), in the inputs' dtype.

    Layer l rotates the disjoint pairs (i, (i+1) % k), i = l%2, l%2+2, ..., by angles[..., l, i//2]:
    even layers pair (0,1),(2,3)...; odd layers (1,2),...,(k-1,0), a cyclic brick wall.
    S = diag(1, s, 1, s, ...) from scale (...) (the identity when scale is None). decay and S enter
    the first layer's 2x2 blocks entry by entry, decay (c, -s s_odd; s, c s_odd); later layers
    pair rows by a reshape to (k/2, 2), after a roll by one row on odd layers. No gather, index
    copy or reduction over a whole matrix: on a CPU those cost more than the rotations.
    """
    L, half = angles.shape[-2], angles.shape[-1]
    c, s = angles[..., 0, :].cos() * decay[..., None], angles[..., 0, :].sin() * decay[..., None]
    c_odd, s_odd = (c, s) if scale is None else (c * scale[..., None], s * scale[..., None])
    M = _block_diagonal(torch.stack([c, -s_odd, s, c_odd], -1).unflatten(-1, (2, 2)))
    for layer in range(1, L):
        odd = layer % 2
        pairs = (M.roll(-1, -2) if odd else M).unflatten(-2, (half, 2))  # pair j: rows p = 2j+odd, q = p+1
        c, s = angles[..., layer, :].cos().unsqueeze(-1), angles[..., layer, :].sin().unsqueeze(-1)
        Mp, Mq = pairs[..., 0, :], pairs[..., 1, :]
        M = torch.stack([c * Mp - s * Mq, s * Mp + c * Mq], -2).flatten(-3, -2)
        if odd:
            M = M.roll(1, -2)
    return M


def _plane_columns(theta, decay, scale=None):
    """The k = 2, one-layer transitions decay R(theta) diag(1, scale) (scale None: 1) by columns,
    as _SmallMatrixRecurrence takes them: theta, decay, scale (B, T, n) -> (B, T, 2, 2, n), column 0
    decay (cos, sin), column 1 decay scale (-sin, cos); the entries rotation_matrices gives."""
    c, s = theta.cos(), theta.sin()
    weight = decay.unsqueeze(2) if scale is None else torch.stack([decay, decay * scale], 2)
    return torch.stack([c, s, -s, c], 2).unflatten(2, (2, 2)) * weight.unsqueeze(3)


def rotation_recurrence(angles, decay, u, h0=None, scale=None):
    """Eager rotation_recurrence. With k = 2 and one layer the transitions go straight into
    _SmallMatrixRecurrence's layout (no (B, T, n, 2, 2) matrices); otherwise rotation_matrices feeds
    matrix_recurrence."""
    dtype = u.dtype
    angles, decay, scale, u, h0 = _upcast(angles, decay, scale, u, h0)
    if angles.shape[-2:] == (1, 1):
        A = _plane_columns(angles[..., 0, 0], decay, scale)
        h = _SmallMatrixRecurrence.apply(A, u.transpose(2, 3), None if h0 is None else h0.transpose(1, 2))
        return h.transpose(2, 3).to(dtype)
    M = rotation_matrices(angles, decay, scale)
    h = matrix_recurrence(M, u.unsqueeze(-1), None if h0 is None else h0.unsqueeze(-1))
    return h.squeeze(-1).to(dtype)
