"""DeltaMinGRU: a per-head d_k x d_v associative memory written by the (gated) delta rule.

Per head and token t, the carried memory is first decayed, then each of nh micro-steps j applies
one generalized Householder update (nh = 1 is DeltaNet, nh > 1 is DeltaProduct):

    H <- gamma_t H
    H <- (I - beta_tj k_tj k_tj^T) H + beta_tj k_tj v_tj^T        j = 1 .. nh
    y_t = H^T q_t

`delta_rule_recurrent` runs this token by token (the oracle, and `step`); `delta_rule_chunked`
computes the same function chunk by chunk in the WY form: within a chunk of C tokens
(M = C nh micro-steps) the pseudo-values u_i = v_i - (gamma_i H_{i-1})^T k_i (what micro-step i
writes) solve one unit lower triangular system (the UT transform), every chunk at once, so that
the chunk maps its start state
affinely, H_end = A H_start + B with A (d_k x d_k). Only the chaining of these maps is sequential
over chunks (a loop, or a log-depth scan).
"""
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from mingru import scans
from mingru.decay import DecayMixin
from mingru.dispatch import dispatch, runs_eager
from mingru.mixers import stacked_params
from mingru.validate import check_input, check_sizes, check_state, data_checkable

# In float32, one enormous log gamma would swamp the chunk's cumulative sum of log gammas and
# blur the decay of its neighbours; exp(-88) is already 0 in float32, so clamping there changes
# no gate while keeping the cumulative sums exact.
LOG_GAMMA_FLOOR = -88.0
# lambda * f(delta_t) above this (in float32) saturates: such gaps all erase the memory alike.
SATURATION_WARN = 1e4
# the forms of `delta_rule_chunked` (its `across`)
ACROSS = (None, "carry", "loop", "scan", "fused")
# DeltaMinGRU(fused=None) runs the fused form where the heads are this narrow (d_k and d_v) and the
# walk is this short (T * nh micro-steps): its chunk kernels do their algebra in IEEE float32 products
# of 16 x 16 blocks, slower per chunk than the default form's batched matmuls as the heads widen, and
# its walk steps through the chunks in order; at narrow heads and short walks it is the faster of the
# two (the seed table's DeltaMinGRU[fused] and DeltaMinGRU[chunked] rows measure both), with a
# fraction of the default's memory and launches.
AUTO_FUSED_WIDTH = 16
AUTO_FUSED_STEPS = 1024


def _micro_steps(k, v, beta):
    """Bring k (B,T,nh,H,d_k), v (B,T,nh,H,d_v), beta (B,T,nh,H) in; nh may be left out."""
    if k.dim() == 4:
        k, v, beta = k.unsqueeze(2), v.unsqueeze(2), beta.unsqueeze(2)
    return k, v, beta


def _check_delta_inputs(q, k, v, beta, log_gamma, h_0):
    for name, t in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point torch.Tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
    if q.dim() != 4:
        raise ValueError(f"q must have shape (B, T, H, d_k), got {tuple(q.shape)}")
    B, T, H, d_k = q.shape
    if k.dim() not in (4, 5):
        raise ValueError(f"k must have shape (B, T, nh, H, d_k) or (B, T, H, d_k), got {tuple(k.shape)}")
    k, v, beta = _micro_steps(k, v, beta)
    nh = k.shape[2]
    if tuple(k.shape) != (B, T, nh, H, d_k):
        raise ValueError(f"k must have shape (B, T, nh, H, d_k) = {(B, T, nh, H, d_k)} to match q, "
                         f"got {tuple(k.shape)}")
    if v.dim() != 5 or tuple(v.shape[:4]) != (B, T, nh, H):
        raise ValueError(f"v must have shape (B, T, nh, H, d_v) with (B, T, nh, H) = {(B, T, nh, H)}, "
                         f"got {tuple(v.shape)}")
    if tuple(beta.shape) != (B, T, nh, H):
        raise ValueError(f"beta must have shape (B, T, nh, H) = {(B, T, nh, H)}, got {tuple(beta.shape)}")
    if log_gamma is not None and tuple(log_gamma.shape) != (B, T, H):
        raise ValueError(f"log_gamma must have shape (B, T, H) = {(B, T, H)}, got {tuple(log_gamma.shape)}")
    want = (B, H, d_k, v.shape[-1])
    if h_0 is not None and tuple(h_0.shape) != want:
        raise ValueError(f"h_0 must have shape (B, H, d_k, d_v) = {want}, got {tuple(h_0.shape)}")
    return k, v, beta


def token_update(h, k, v, beta, log_gamma=None):
    """One token of the recurrence on h (B,H,d_k,d_v): k (B,nh,H,d_k), v (B,nh,H,d_v), beta (B,nh,H)."""
    if log_gamma is not None:
        h = h * log_gamma.exp()[..., None, None]
    for j in range(k.shape[1]):
        kj, bj = k[:, j], beta[:, j, :, None, None]
        u = v[:, j] - torch.einsum("bhk,bhkv->bhv", kj, h)
        h = h + bj * kj.unsqueeze(-1) * u.unsqueeze(-2)
    return h


def delta_rule_recurrent(q, k, v, beta, log_gamma=None, h_0=None):
    """The sequential oracle of `delta_rule_chunked`: same arguments, same result, one token a step."""
    k, v, beta = _check_delta_inputs(q, k, v, beta, log_gamma, h_0)
    B, T, H, d_k = q.shape
    h = q.new_zeros(B, H, d_k, v.shape[-1]) if h_0 is None else h_0
    ys = []
    for t in range(T):
        h = token_update(h, k[:, t], v[:, t], beta[:, t], None if log_gamma is None else log_gamma[:, t])
        ys.append(torch.einsum("bhk,bhkv->bhv", q[:, t], h))
    y = torch.stack(ys, 1) if ys else q.new_zeros(B, 0, H, v.shape[-1])
    return y, h


def _to_chunks(x, N, C):
    """(B, T, nh, H, d) -> (N, B, H, C*nh, d), zero-padded to N*C tokens, token-major micro-steps;
    contiguous (one copy): a batched matmul given a strided 5-d operand copies it on every use, and
    autograd would keep each copy."""
    B, T, nh, H, d = x.shape
    if N * C != T:  # a pad copies even when it adds nothing
        x = F.pad(x, (0, 0, 0, 0, 0, 0, 0, N * C - T))
    return x.reshape(B, N, C, nh, H, d).permute(1, 0, 4, 2, 3, 5).reshape(N, B, H, C * nh, d).contiguous()


def delta_rule_chunked(q, k, v, beta, log_gamma=None, h_0=None, chunk_size=64, across=None):
    """The delta rule over a whole sequence, chunk-parallel; returns (y (B,T,H,d_v), h_T (B,H,d_k,d_v)).

    q (B,T,H,d_k); k (B,T,nh,H,d_k); v (B,T,nh,H,d_v); beta (B,T,nh,H); with nh = 1 the nh axis
    may be left out. log_gamma (B,T,H) <= 0 decays the memory once per token before its updates
    (None: no decay); h_0 (B,H,d_k,d_v) defaults to zeros. The readout is y_t = H_t^T q_t with no
    scale, and k is used as given (the mixer L2-normalizes it). chunk_size changes only rounding;
    padded tokens carry beta = 0 and gamma = 1, the identity. Half-precision inputs are computed
    in float32 and the results cast back.

    Two forms. The affine maps: every chunk's UT transform at once gives the map H_end = A H_start
    + B, and only the chaining of the maps is sequential; the solves and the chaining go through
    the dispatch seam (`unit_lower_solve`, `matrix_recurrence`): Triton kernels on CUDA where
    MINGRU_SCAN allows. The carried form (`_carry`): chunk after chunk from the carried state,
    with half the solve's right-hand sides and no d_k x d_k maps. `across`: None (default) takes
    the carried form for one chunk (T <= chunk_size: nothing to chain, and the carried form does a
    part of the affine form's work) and where dispatch runs eager (a CPU, MINGRU_SCAN=eager), and
    the affine maps elsewhere; "carry" forces the carried form; "loop" (one batched matmul a chunk) or "scan"
    (scans.matrix_recurrence, whose Hillis–Steele over the chunk totals takes fewer launches than
    the loop when there are many) force the affine maps with that eager chaining. "fused" runs the
    whole rule in Triton kernels that read the inputs in place (`mingru.kernels.delta_rule`: every
    chunk's algebra in a program of its own, a walk through the chunks, nothing of size M x M kept
    for the backward) through the dispatch seam; where dispatch runs eager, or the kernels decline (d_k or d_v above
    their tile), it is the default form.
    """
    k, v, beta = _check_delta_inputs(q, k, v, beta, log_gamma, h_0)
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if across not in ACROSS:
        raise ValueError(f"across must be one of {', '.join(map(repr, ACROSS))}, got {across!r}")
    with torch.autocast(q.device.type, enabled=False):  # the algebra below runs in float32 or float64
        return _chunked(q, k, v, beta, log_gamma, h_0, chunk_size, across)


def _chunked(q, k, v, beta, log_gamma, h_0, chunk_size, across):
    """delta_rule_chunked on checked inputs, k, v, beta with their nh axis."""
    B, T, nh, H, d_k = k.shape
    d_v = v.shape[-1]
    out_dtype = q.dtype
    q, k, v, beta, log_gamma, h_0 = scans._upcast(q, k, v, beta, log_gamma, h_0)  # the solve needs float32
    if T == 0:
        h = q.new_zeros(B, H, d_k, d_v) if h_0 is None else h_0
        return q.new_zeros(B, 0, H, d_v).to(out_dtype), h.to(out_dtype)
    if across == "fused":
        y, h = dispatch("delta_rule", _unfused, q, k, v, beta, log_gamma, h_0, chunk_size, local=True)
        return y.to(out_dtype), h.to(out_dtype)
    C = min(chunk_size, T)
    N = -(-T // C)
    M = C * nh
    Q = _to_chunks(q.unsqueeze(2), N, C)                 # (N,B,H,C,d_k)
    K = _to_chunks(k, N, C)                              # (N,B,H,M,d_k)
    V = _to_chunks(v, N, C)                              # (N,B,H,M,d_v)
    b = _to_chunks(beta.unsqueeze(-1), N, C).squeeze(-1)  # (N,B,H,M)

    causal = None  # read's mask (see `_causal`); at nh = 1 the lower triangle, which needs none
    if nh > 1:
        token = torch.arange(M, device=q.device) // nh   # micro-step -> token within the chunk
        causal = token[None, :] <= torch.arange(C, device=q.device)[:, None]  # (C, M)

    lg = None if log_gamma is None else _to_chunks(log_gamma[:, :, None, :, None], N, C)[..., 0]  # (N,B,H,C)
    if across == "carry" or (across is None and (N == 1 or runs_eager(q))):
        Y, h = _carry(Q, K, V, b, lg, nh, causal, h_0)
        return _from_chunks(Y, T).to(out_dtype), h.to(out_dtype)
    tri, read, Kh, Qh, Kc, log_end = _chunk_terms(Q, K, b, lg, nh)
    read = _causal(read, causal, inplace=True)
    # tri stays unmasked: the solves read only its strictly lower part, so its gradient has no other entries
    # u = U0 - W H_start with [U0 | W] = T^{-1} [V | P K]: one solve for every chunk at once.
    # Several chunks go through the dispatch seam (Triton on CUDA); one chunk took the carried form.
    UW = dispatch("unit_lower_solve", scans.unit_lower_solve, tri, torch.cat([V, Kh], -1), local=True)
    U0, W = UW.split([d_v, d_k], dim=-1)
    eye = torch.eye(d_k, dtype=q.dtype, device=q.device)
    A = (eye if log_end is None else log_end[..., None, None].exp() * eye) - Kc @ W  # H_end = A H_start + Bc
    Bc = Kc @ U0
    # read multiplies [U0 | W] once, so its gradient (M x M a chunk) is formed once
    Y0, RW = (read @ UW).split([d_v, d_k], dim=-1)
    Qt = Qh - RW                                         # y = Qt H_start + Y0

    chain = scans.matrix_recurrence if across == "scan" else _walk
    h = q.new_zeros(B, H, d_k, d_v) if h_0 is None else h_0
    after = dispatch("matrix_recurrence", chain, A.transpose(0, 1), Bc.transpose(0, 1), h, local=True)
    del Bc  # the chain does not keep it: freed before the output is formed
    Hs = torch.cat([h.unsqueeze(0), after.transpose(0, 1)[:-1]])  # (N,B,H,d_k,d_v) at chunk starts, dense
    G = N * B * H
    Y = torch.baddbmm(Y0.reshape(G, C, d_v), Qt.reshape(G, C, d_k), Hs.view(G, d_k, d_v)).view(N, B, H, C, d_v)
    del Y0, RW  # the views of read @ [U0 | W]: its memory goes before the output's copy
    return _from_chunks(Y, T).to(out_dtype), after[:, -1].to(out_dtype)


def split_projection(proj, n_heads, nh, d_k, d_v):
    """Views q (..., H, d_k), k (..., nh, H, d_k), v (..., nh, H, d_v), beta (..., nh, H) of DeltaMinGRU's
    projection output proj (..., W), whose last dim lies as [q | k | v | beta] with the micro-steps
    j-major within k, v and beta; k and beta as projected (not yet normalized and gated)."""
    H = n_heads
    q, k, v, beta = proj.split([H * d_k, nh * H * d_k, nh * H * d_v, nh * H], -1)
    return q.unflatten(-1, (H, d_k)), k.unflatten(-1, (nh, H, d_k)), v.unflatten(-1, (nh, H, d_v)), \
        beta.unflatten(-1, (nh, H))


def heads(proj, n_heads, nh, d_k, d_v):
    """q, k (unit norm), v, beta = 2 sigmoid(.) in (0, 2) from the projection output (`split_projection`)."""
    q, k, v, beta = split_projection(proj, n_heads, nh, d_k, d_v)
    return q, F.normalize(k, dim=-1), v, 2 * torch.sigmoid(beta)


def delta_layer(proj, log_gamma, h_0, chunk_size, n_heads, nh, d_k, d_v):
    """DeltaMinGRU's fused form: `delta_rule_chunked` of `heads(proj, ...)` with the keys normalized and
    the write strengths gated inside the Triton kernels (`kernels.delta_rule.delta_layer`), which
    read the projection output in place and write its gradient as one buffer. Where dispatch runs
    eager, or the kernels decline, it is the default form. Returns (y (B,T,H,d_v), h_T (B,H,d_k,d_v))."""
    out_dtype = proj.dtype
    with torch.autocast(proj.device.type, enabled=False):
        proj, log_gamma, h_0 = scans._upcast(proj, log_gamma, h_0)  # the rule runs in float32 (see _chunked)
        y, h = dispatch("delta_layer", _layer_default, proj, log_gamma, h_0, chunk_size, n_heads, nh, d_k, d_v,
                        local=True)
    return y.to(out_dtype), h.to(out_dtype)


def _layer_default(proj, log_gamma, h_0, chunk_size, n_heads, nh, d_k, d_v):
    """The default form on the layer's projection output: keys normalized and strengths gated by torch,
    then `delta_rule_chunked`."""
    return delta_rule_chunked(*heads(proj, n_heads, nh, d_k, d_v), log_gamma, h_0, chunk_size)


def _unfused(q, k, v, beta, log_gamma, h_0, chunk_size):
    """The fused form's eager stand-in: the default form on the same (float32 or float64) inputs."""
    return _chunked(q, k, v, beta, log_gamma, h_0, chunk_size, None)


def _from_chunks(Y, T):
    """(N, B, H, C, d_v) -> (B, T, H, d_v)."""
    N, B, H, C, d_v = Y.shape
    return Y.permute(1, 0, 3, 2, 4).reshape(B, N * C, H, d_v)[:, :T]


def _chunk_terms(Q, K, b, lg, nh):
    """What the WY form needs of chunks (any leading dims; Q (..,C,d_k), K (..,M,d_k), b (..,M), lg (..,C)
    or None): tri (..,M,M) whose strictly lower part is T[i, l] = beta_l (k_i . k_l) P_i / P_l; read
    (..,C,M) whose entries on micro-steps l of tokens <= t are beta_l (q_t . k_l) P_t / P_l. The
    rest of tri and read is finite and no part of them: the caller masks it (or, for tri, solves
    reading only the strictly lower part). Kh = P K and Qh = P Q (the start
    state seen through the decay); Kc (..,d_k,M) = (beta_l P_end / P_l k_l) as columns; log P_end
    (..) or None. P is the chunk-relative cumulative decay."""
    bK = (b.unsqueeze(-1) * K).transpose(-1, -2)           # beta enters as the columns' scale, before
    tri, read = K @ bK, Q @ bK                            # the products: an M x d_k pass, not M x M
    Kc, Kh, Qh, log_end = bK, K, Q, None
    if lg is not None:
        cum_t = lg.cumsum(-1)                            # log P at each token, chunk-relative
        cum_m = cum_t.repeat_interleave(nh, dim=-1)      # ... at each micro-step
        tri = tri * (cum_m[..., :, None] - cum_m[..., None, :]).clamp(max=0).exp()
        read = read * (cum_t[..., :, None] - cum_m[..., None, :]).clamp(max=0).exp()
        Kc = bK * (cum_t[..., -1:] - cum_m).exp().unsqueeze(-2)  # u_l's weight in the chunk-end state
        Kh = K * cum_m.exp().unsqueeze(-1)
        Qh = Q * cum_t.exp().unsqueeze(-1)
        log_end = cum_t[..., -1]
    return tri, read, Kh, Qh, Kc, log_end


def _carry(Q, K, V, b, lg, nh, causal, h):
    """The chunks one after another, each from the state the previous one left (the carried form):
    u = T^{-1} (V - Kh H_start), y = Qh H_start + read u, H_end = P_end H_start + Kc u. Its solve has
    d_v right-hand sides (the affine maps' has d_v + d_k) and it forms no d_k x d_k map, so where
    the chunks run one at a time anyway (eager) it is the cheaper form. The terms that do not read
    the state are formed for every chunk at once (under autograd); `_Carried` runs the chain.
    h (B,H,d_k,d_v), or None for a zero start state (the first chunk then skips its state terms);
    causal: read's mask, None at nh = 1 (see `_causal`). Returns (Y (N,B,H,C,d_v), H_T)."""
    N, B, H, _, d_k = K.shape
    d_v = V.shape[-1]
    tri, read, Kh, Qh, Kc, log_end = _chunk_terms(Q, K, b, lg, nh)
    flat = [x.flatten(1, 2) for x in (tri, read, Kh, Qh, Kc, V)]  # (N, B*H, ...): views
    decay = None if log_end is None else log_end.exp().flatten(1, 2)
    Y, h = _Carried.apply(*flat, decay, None if h is None else h.reshape(B * H, d_k, d_v), causal)
    return Y.unflatten(1, (B, H)), h.view(B, H, d_k, d_v)


def _causal(x, causal, inplace=False):
    """x (.., C, M) with the micro-steps after each token zeroed; causal None means nh = 1, the lower
    triangle (tril runs far faster than a masked_fill with a broadcast mask)."""
    if causal is None:
        return x.tril_() if inplace else x.tril()
    return x.masked_fill_(~causal, 0.0) if inplace else x.masked_fill(~causal, 0.0)


def _stack(xs):
    return xs[0].unsqueeze(0) if len(xs) == 1 else torch.stack(xs)  # one chunk: no copy


def _from_chunk(first, x, like):
    """x, the gradient of chunks first.. of `like`, as one of every chunk (zeros before `first`)."""
    if not first:
        return x
    out = torch.zeros_like(like)
    out[first:] = x
    return out


class _Carried(torch.autograd.Function):
    """The carried chain over chunks n = 0..N-1 (every tensor (N, G, ...), G = B*H; decay (N, G) or None):

        u_n = T_n^{-1} (V_n - Kh_n h_n),  h_{n+1} = decay_n h_n + Kc_n u_n,  Y_n = Qh_n h_n + read_n u_n

    T_n = I + the strictly lower part of tri_n (the rest is never read); read_n is masked here, to
    the micro-steps of each token and before (`causal`, see `_causal`), so that its gradient is
    masked in place. h_0 None is a zero start: chunk 0's terms in h_0 are skipped, and so are
    their gradients (the state terms run over the chunks from `first`, 1 for a zero start, else 0).
    Forward: per chunk one solve and two batched multiply-adds; Y for every chunk at once after the
    chain. Where dispatch runs kernels, one launch inverts every chunk's T first (`_inverses`), each
    solve is then a batched matmul, and the inverses are kept in place of tri for the backward.
    Backward, the adjoint chain from the last chunk: du_n = read_n^T dY_n + Kc_n^T dh_{n+1},
    dr_n = T_n^{-T} du_n, dh_n = decay_n dh_{n+1} + Qh_n^T dY_n - Kh_n^T dr_n; then every other
    gradient for all chunks at once (dV = dr, dKh = -dr h^T, dtri = -(dr u^T) strictly lower,
    dread = dY u^T masked, ...). Autograd records no step: the backward keeps the inputs, the chunk
    start states and the u's.
    """

    @staticmethod
    def forward(ctx, tri, read, Kh, Qh, Kc, V, decay, h, causal):
        first = int(h is None)
        read = _causal(read, causal)
        inv = _inverses(tri)
        system = tri if inv is None else inv  # what the solves read: T's lower part, or T^{-1}
        inverted = inv is not None
        starts, U = [], []
        for n in range(tri.shape[0]):
            if h is None:
                U.append(_solve(system[n], inverted, V[n]))
                h = torch.bmm(Kc[n], U[n])
                continue
            starts.append(h)
            U.append(_solve(system[n], inverted, torch.baddbmm(V[n], Kh[n], h, alpha=-1)))
            h = torch.baddbmm(h if decay is None else decay[n, :, None, None] * h, Kc[n], U[n])
        U = _stack(U)
        Y = torch.matmul(read, U)
        if starts:
            starts = _stack(starts)
            Y[first:].flatten(0, 1).baddbmm_(Qh[first:].flatten(0, 1), starts.flatten(0, 1))
        else:
            starts = U.new_zeros(0, *h.shape)
        ctx.first, ctx.causal, ctx.inverted = first, causal, inverted
        ctx.save_for_backward(system, read, Kh, Qh, Kc, decay, starts, U)
        return Y, h

    @staticmethod
    @once_differentiable
    def backward(ctx, dY, dh):
        system, read, Kh, Qh, Kc, decay, starts, U = ctx.saved_tensors
        first = ctx.first
        dh = Kc.new_zeros(Kc.shape[1], Kc.shape[2], U.shape[-1]) if dh is None else dh
        read_dY = torch.matmul(read.mT, dY)              # (N, G, M, d_v)
        Qh_dY = torch.matmul(Qh[first:].mT, dY[first:])  # (N - first, G, d_k, d_v)
        dR, ends = [], []                                # dr_n, dh_{n+1}, from the last chunk
        for n in range(system.shape[0] - 1, -1, -1):
            ends.append(dh)
            du = torch.baddbmm(read_dY[n], Kc[n].mT, dh)  # then dr = T^{-T} du
            dR.append(_solve(system[n], ctx.inverted, du, transpose=True))
            if n < first:
                break  # a zero start state takes no gradient
            q_dy = Qh_dY[n - first]
            carried = q_dy + dh if decay is None else torch.addcmul(q_dy, decay[n, :, None, None], dh)
            dh = torch.baddbmm(carried, Kh[n].mT, dR[-1], alpha=-1)
        dR, ends = _stack(dR[::-1]), _stack(ends[::-1])
        Ut = U.mT
        dtri = torch.matmul(-dR, Ut).tril_(-1)
        dread = _causal(torch.matmul(dY, Ut), ctx.causal, inplace=True)
        dKc = torch.matmul(ends, Ut)
        dKh = dQh = ddecay = None  # all zero when no chunk has a start state
        if len(starts):
            dKh = _from_chunk(first, torch.matmul(-dR[first:], starts.mT), Kh)
            dQh = _from_chunk(first, torch.matmul(dY[first:], starts.mT), Qh)
            if decay is not None:
                ddecay = _from_chunk(first, (ends[first:] * starts).sum((-2, -1)), decay)
        return dtri, dread, dKh, dQh, dKc, dR, ddecay, None if first else dh, None


def _solve(system, inverted, rhs, transpose=False):
    """T^{-1} rhs (T^{-T} rhs with `transpose`) for each chunk's T = I + strict_lower(tri): a matmul
    when `system` holds T^{-1} (`inverted`), else a triangular solve that reads tri's strictly lower
    part (the transposed one as an upper solve with tri^T: a lower solve from the right, the same
    thing, ran several times slower on a CPU)."""
    if inverted:
        return torch.bmm(system.mT if transpose else system, rhs)
    if transpose:
        return torch.linalg.solve_triangular(system.mT, rhs, upper=True, unitriangular=True)
    return scans.unit_lower_solve(system, rhs)


def _inverses(tri):
    """Every chunk's T^{-1} = (I + strict_lower(tri))^{-1} from the Triton kernel, where dispatch runs
    kernels, else None: eager, the carried form solves chunk by chunk (on a CPU a solve with d_v
    right-hand sides costs less than an inverse). With the inverses each solve is one batched
    matmul, and the backward's transposed solves read them in place of tri."""
    if runs_eager(tri):
        return None
    return dispatch("unit_lower_inverse", scans.unit_lower_inverse, tri, local=True)


def _walk(A, X, h):
    """matrix_recurrence by one batched matmul a step: A (B,N,H,k,k), X (B,N,H,k,v), h (B,H,k,v)."""
    B, N, H, d_k, d_v = X.shape
    h = h.reshape(B * H, d_k, d_v)
    after = []
    # unbind, not A[:, n]: the backward of N separate selects would fill N full-size zero gradients
    for A_n, X_n in zip(A.unbind(1), X.unbind(1)):
        h = torch.baddbmm(X_n.reshape(B * H, d_k, d_v), A_n.reshape(B * H, d_k, d_k), h)
        after.append(h.view(B, H, d_k, d_v))
    return torch.stack(after, 1)


class DeltaMinGRU(DecayMixin, nn.Module):
    """n_heads associative memories H (d_k x d_v each) written by nh delta-rule updates a token.

    Per micro-step j: k = normalize(linear_k[j](x)), v = linear_v[j](x),
    beta = 2 sigmoid(linear_beta[j](x)) in (0, 2) (beta = 2 with a unit k is a reflection);
    q = linear_q(x), and the heads' readouts H^T q go through out_proj to hidden_size.
    The memory starts empty (zeros) unless h_0 is given; with decay, gamma = exp(-lambda f(dt))
    (one rate per head when learnable) scales the carried memory once per token, before its
    updates. `forward` runs `delta_rule_chunked`; `step` runs one token of the recurrence.
    The state is H flattened in (n_heads, d_k, d_v) order: (B, 1, n_heads d_k d_v) in `forward`,
    (B, n_heads d_k d_v) in `step`. Under MINGRU_SCAN=auto on CUDA the chunks' triangular solves
    and their chaining run Triton kernels when there are two chunks or more (`delta_rule_chunked`);
    the rest is torch code. The fused form (`delta_layer`) runs the whole rule in Triton kernels
    that read the projection output as it is, normalize the keys and gate the strengths themselves,
    and keep nothing of size chunk x chunk for the backward; where dispatch runs eager it is the
    default form. `fused` (our one extra keyword) chooses: None (default) by shape, the fused form
    where d_k, d_v <= AUTO_FUSED_WIDTH and T nh <= AUTO_FUSED_STEPS (see there), else the default
    form; True or False forces one.
    """

    carries_matrix_state = True

    def __init__(self, input_size, hidden_size, bias=True, n_heads=4, nh=1, d_k=None, d_v=None,
                 chunk_size=64, decay=None, decay_rate=1.0, log1p_delta=False, fused=None):
        super().__init__()
        check_sizes("DeltaMinGRU", input_size=input_size, hidden_size=hidden_size, n_heads=n_heads, nh=nh,
                    chunk_size=chunk_size, d_k=1 if d_k is None else d_k, d_v=1 if d_v is None else d_v)
        if fused is not None and not isinstance(fused, bool):
            raise TypeError(f"fused must be None (chosen by shape), True or False, got {fused!r}")
        if d_k is None and hidden_size % n_heads:
            raise ValueError(f"hidden_size ({hidden_size}) must be divisible by n_heads ({n_heads}) "
                             "when d_k is not given (d_k defaults to hidden_size // n_heads)")
        self.input_size, self.hidden_size = input_size, hidden_size
        self.n_heads, self.nh, self.chunk_size, self.fused = n_heads, nh, chunk_size, fused
        self.d_k = hidden_size // n_heads if d_k is None else d_k
        self.d_v = self.d_k if d_v is None else d_v
        # Created in mingru-scans' order, so one torch.manual_seed gives both the same weights.
        self.linear_q = nn.Linear(input_size, n_heads * self.d_k, bias=bias)
        self.linear_k = nn.ModuleList(nn.Linear(input_size, n_heads * self.d_k, bias=bias)
                                      for _ in range(nh))
        self.linear_v = nn.ModuleList(nn.Linear(input_size, n_heads * self.d_v, bias=bias)
                                      for _ in range(nh))
        self.linear_beta = nn.ModuleList(nn.Linear(input_size, n_heads, bias=bias) for _ in range(nh))
        self.out_proj = nn.Linear(n_heads * self.d_v, hidden_size, bias=bias)
        self._warned_saturation = False
        self._init_decay(decay, decay_rate, log1p_delta, num_channels=n_heads)

    @property
    def state_size(self):
        return self.n_heads * self.d_k * self.d_v

    def _project(self, x):
        """The projection output (..., W): q, the micro-steps' k, v and beta pre-activations side by
        side (`split_projection`), from one matmul over the stacked weights."""
        return F.linear(x, *stacked_params(self.linear_q, *self.linear_k, *self.linear_v, *self.linear_beta))

    def _log_gamma(self, dt, lead):
        """log gamma per head, (*lead, n_heads); float32 and below are clamped at LOG_GAMMA_FLOOR."""
        log_gamma = self._decay_log_gamma(dt).expand(*lead, self.n_heads)
        if log_gamma.dtype != torch.float64:
            if (not self._warned_saturation and data_checkable(log_gamma)
                    and bool((log_gamma < -SATURATION_WARN).any())):
                self._warned_saturation = True
                warnings.warn(f"lambda * delta_t exceeds {SATURATION_WARN:g}: those tokens erase the "
                              "memory and larger gaps cannot be told apart; use log1p_delta=True or "
                              "rescale delta_t to keep them distinct", stacklevel=3)
            log_gamma = log_gamma.clamp(min=LOG_GAMMA_FLOOR)
        return log_gamma

    def _check_x(self, x, step):
        check_input("DeltaMinGRU", x, self, step, self.input_size)

    def _state(self, h, want, name, like):
        if h is None:
            return like.new_zeros(want[0], self.n_heads, self.d_k, self.d_v)
        if not isinstance(h, torch.Tensor) or tuple(h.shape) != want:
            got = tuple(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__
            raise ValueError(f"{name} must have shape {want} (B, {'1, ' if len(want) == 3 else ''}"
                             f"n_heads*d_k*d_v), got {got}")
        check_state("DeltaMinGRU", name, h, like)
        return h.reshape(want[0], self.n_heads, self.d_k, self.d_v)

    def forward(self, x, h_0=None, delta_t=None, return_state=False):
        """x (B, T, input_size) -> y (B, T, hidden_size), or (y, h_T (B, 1, n_heads d_k d_v))."""
        self._check_x(x, step=False)
        B, T, _ = x.shape
        dt = self._prepare_decay(delta_t, (B, T))
        h = None if h_0 is None else self._state(h_0, (B, 1, self.state_size), "h_0", x)  # None: zeros
        log_gamma = None if dt is None else self._log_gamma(dt, (B, T))
        rule = delta_layer if self.fuses(T) else _layer_default
        y, h = rule(self._project(x), log_gamma, h, self.chunk_size, self.n_heads, self.nh, self.d_k, self.d_v)
        y = self.out_proj(y.reshape(B, T, self.n_heads * self.d_v))
        return (y, h.reshape(B, 1, self.state_size)) if return_state else y

    def fuses(self, T):
        """Whether `forward` over T tokens runs the fused form (`fused`, or by shape when None)."""
        if self.fused is not None:
            return self.fused
        return max(self.d_k, self.d_v) <= AUTO_FUSED_WIDTH and T * self.nh <= AUTO_FUSED_STEPS

    @torch.no_grad()
    def step(self, x_t, h_prev=None, delta_t=None):
        """x_t (B, input_size), h_prev (B, n_heads d_k d_v) -> (y_t (B, hidden_size), h_t like h_prev)."""
        self._check_x(x_t, step=True)
        B = x_t.shape[0]
        dt = self._prepare_decay(delta_t, (B,))
        h = self._state(h_prev, (B, self.state_size), "h_prev", x_t)
        q, k, v, beta = heads(self._project(x_t), self.n_heads, self.nh, self.d_k, self.d_v)
        h = token_update(h, k, v, beta, None if dt is None else self._decay_log_gamma(dt))
        y = torch.einsum("bhk,bhkv->bhv", q, h).reshape(B, self.n_heads * self.d_v)
        return self.out_proj(y), h.reshape(B, self.state_size)

    def extra_repr(self):
        return (f"input_size={self.input_size}, hidden_size={self.hidden_size}, n_heads={self.n_heads}, "
                f"nh={self.nh}, d_k={self.d_k}, d_v={self.d_v}, chunk_size={self.chunk_size}, "
                f"decay={self.decay!r}, fused={self.fused}")
