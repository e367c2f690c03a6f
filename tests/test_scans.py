"""Eager chunked scans against the float64 sequential loops: outputs, gradients, dtypes."""
import pytest
import torch
import torch.nn.functional as F

import mingru
from gradutil import outputs_and_grads as _grads
from mingru import naive, scans

pytestmark = pytest.mark.usefixtures("eager_mode")

TS = [1, 2, 7, 64, 100, 257]


def _check(op, ref, inputs, atol, rtol=1e-5):
    outs, grads = _grads(op, inputs, _cotangents(op, inputs))
    ref_outs, ref_grads = _grads(ref, [x.double() for x in inputs], _cotangents(op, inputs))
    for got, want in zip(outs + grads, ref_outs + ref_grads):
        torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)


def _cotangents(op, inputs):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        outs = op(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in outs]


def _linear_inputs(B, T, D, dtype=torch.float32, signed=True):
    g = torch.Generator().manual_seed(T * 1000 + D)
    a = torch.rand(B, T, D, generator=g) * 0.9 + 0.05
    if signed:
        a = a * torch.where(torch.rand(B, T, D, generator=g) < 0.5, -1.0, 1.0)
    return a.to(dtype), torch.randn(B, T, D, generator=g).to(dtype)


@pytest.mark.parametrize("T", TS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("B,D", [(1, 1), (2, 5), (3, 16)], ids=lambda x: str(x))
def test_linear_scan(B, T, D):
    _check(mingru.linear_scan, naive.linear_scan_naive, _linear_inputs(B, T, D), atol=1e-5)


@pytest.mark.parametrize("T", TS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("with_h0", [False, True], ids=["zero-h0", "h0"])
def test_linear_recurrence(T, with_h0):
    a, b = _linear_inputs(2, T, 5)
    h0 = torch.randn(2, 5) if with_h0 else None
    inputs = [a, b] + ([h0] if with_h0 else [])
    _check(mingru.linear_recurrence, naive.linear_recurrence_naive, inputs, atol=1e-5)


@pytest.mark.parametrize("T", TS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("h0_kind", ["positive", "signed", "zero"])
def test_gated_recurrence(T, h0_kind):
    """Any h0 sign gets the exact states and gradients; at h0 = 0 the h0 gradient is the product of
    the 1 - z (a log-space scan would clamp h0 and return 0)."""
    g = torch.Generator().manual_seed(T)
    k, cand = 3 * torch.randn(2, T, 5, generator=g), 2 * torch.randn(2, T, 5, generator=g)
    h0 = {"positive": torch.rand(2, 5, generator=g), "signed": torch.randn(2, 5, generator=g),
          "zero": torch.zeros(2, 5)}[h0_kind]
    _check(mingru.gated_recurrence, naive.gated_recurrence_naive, [k, cand, h0], atol=1e-5)


def _log_inputs(B, T, D, dtype=torch.float32):
    g = torch.Generator().manual_seed(T * 7 + D)
    lc = -F.softplus(torch.randn(B, T, D, generator=g))
    return lc.to(dtype), torch.randn(B, T + 1, D, generator=g).to(dtype)


@pytest.mark.parametrize("T", TS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("B,D", [(1, 1), (2, 5)], ids=lambda x: str(x))
def test_parallel_scan_log(B, T, D):
    _check(mingru.parallel_scan_log, naive.parallel_scan_log_naive, _log_inputs(B, T, D), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("T", [9, 200], ids=lambda t: f"T{t}")
def test_parallel_scan_log_zero_h0_has_finite_grads(T):
    lc, lv = _log_inputs(2, T, 3)
    lv[:, 0] = float("-inf")
    _check(mingru.parallel_scan_log, naive.parallel_scan_log_naive, [lc, lv], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("T", [9, 200], ids=lambda t: f"T{t}")
def test_parallel_scan_log_zero_coefficient_cuts_the_past(T):
    lc, lv = _log_inputs(2, T, 3)
    lc[:, ::5] = float("-inf")
    _check(mingru.parallel_scan_log, naive.parallel_scan_log_naive, [lc, lv], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["very-negative-log-a", "large-values", "zero-h0-long"])
def test_parallel_scan_log_extreme_inputs_stay_accurate(case):
    """Over T = 2000 the log coefficients sum to about -3e4 (-1e3 for large values); restarting a*
    at every chunk keeps float32 within a few 1e-5 of the float64 loop, where one cumsum over the
    whole sequence would lose about 2^-24 * 3e4 = 2e-3 to cancellation."""
    g = torch.Generator().manual_seed(5)
    T = 2000
    lc = -30 * torch.rand(2, T, 4, generator=g) if case == "very-negative-log-a" else \
        -F.softplus(torch.randn(2, T, 4, generator=g))
    lv = torch.randn(2, T + 1, 4, generator=g) + (60 if case == "large-values" else 0)
    if case == "zero-h0-long":
        lv[:, 0] = float("-inf")
    h = mingru.parallel_scan_log(lc, lv)
    want = naive.parallel_scan_log_naive(lc, lv)
    assert want.abs().max() > (1e25 if case == "large-values" else 0)
    torch.testing.assert_close(h.double(), want, rtol=1e-4, atol=0)


@pytest.mark.parametrize("op,ref", [(mingru.linear_scan, naive.linear_scan_naive),
                                    (mingru.linear_recurrence, naive.linear_recurrence_naive)],
                         ids=["linear_scan", "linear_recurrence"])
def test_linear_zero_and_negative_coefficients(op, ref):
    """a_t = 0 cuts the past off and a_t < 0 flips it: outputs and gradients still match float64."""
    a, b = _linear_inputs(2, 50, 3)
    a[:, ::7] = 0.0
    _check(op, ref, [a, b], atol=1e-5)


def _matrix_inputs(B, T, n, k, v, dtype=torch.float32):
    g = torch.Generator().manual_seed(T * 31 + k * 5 + v)
    A = torch.randn(B, T, n, k, k, generator=g) / (k ** 0.5)  # spectral radius ~1: no blow-up
    return A.to(dtype), torch.randn(B, T, n, k, v, generator=g).to(dtype)


@pytest.mark.parametrize("T", TS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("k,v", [(1, 1), (2, 1), (4, 2), (8, 1), (16, 16)], ids=lambda x: str(x))
def test_matrix_affine_scan(T, k, v):
    if T == 257 and k == 16:
        pytest.skip("covered by smaller T; keeps the suite fast")
    A, Bm = _matrix_inputs(2, T, 3, k, v)
    A = A * 0.9
    _check(mingru.matrix_affine_scan, naive.matrix_affine_scan_naive, [A, Bm], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("T", [1, 7, 100], ids=lambda t: f"T{t}")
def test_matrix_scan(T):
    A, Bm = _matrix_inputs(2, T, 4, 2, 1)
    _check(mingru.matrix_scan, naive.matrix_scan_naive, [A * 0.9, Bm.squeeze(-1)], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("T", [1, 7, 64, 37], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("with_h0", [False, True], ids=["zero-h0", "h0"])
def test_matrix_recurrence(T, with_h0):
    A, X = _matrix_inputs(2, T, 3, 4, 2)
    inputs = [A * 0.9, X] + ([torch.randn(2, 3, 4, 2)] if with_h0 else [])
    _check(mingru.matrix_recurrence, naive.matrix_recurrence_naive, inputs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k,L", [(2, 1), (4, 2), (8, 6)], ids=lambda x: str(x))
@pytest.mark.parametrize("T", [1, 7, 64], ids=lambda t: f"T{t}")
def test_rotation_recurrence(T, k, L):
    g = torch.Generator().manual_seed(T + k)
    angles = torch.randn(2, T, 3, L, k // 2, generator=g)
    decay, u, h0 = torch.rand(2, T, 3, generator=g), torch.randn(2, T, 3, k, generator=g), torch.randn(2, 3, k, generator=g)
    _check(mingru.rotation_recurrence, naive.rotation_recurrence_naive, [angles, decay, u, h0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k,L", [(2, 1), (2, 2), (8, 1), (8, 4)])
def test_rotation_matrices_are_decayed_rotations(k, L):
    angles, decay = torch.randn(5, 3, L, k // 2, dtype=torch.float64), torch.rand(5, 3, dtype=torch.float64)
    M = scans.rotation_matrices(angles, decay)
    torch.testing.assert_close(M, naive.givens_matrices_naive(angles, decay))
    eye = torch.eye(k, dtype=torch.float64).expand_as(M)
    torch.testing.assert_close(M @ M.mT, decay[..., None, None] ** 2 * eye)
    scale = torch.rand(5, 3, dtype=torch.float64)  # S = diag(1, s, 1, s, ...) on the right
    S = torch.diag_embed(torch.stack([torch.ones_like(scale), scale], -1).repeat(1, 1, k // 2))
    torch.testing.assert_close(scans.rotation_matrices(angles, decay, scale), M @ S)


@pytest.mark.parametrize("op,make", [
    (mingru.linear_scan, lambda: [x.double() for x in _linear_inputs(1, 5, 2)]),
    (mingru.parallel_scan_log, lambda: [x.double() for x in _log_inputs(1, 5, 2)]),
    (mingru.matrix_affine_scan, lambda: [x.double() for x in _matrix_inputs(1, 5, 2, 2, 3)]),
    (mingru.rotation_recurrence, lambda: [torch.randn(1, 5, 2, 2, 2, dtype=torch.float64),
                                          torch.rand(1, 5, 2, dtype=torch.float64),
                                          torch.randn(1, 5, 2, 4, dtype=torch.float64)]),
], ids=["linear_scan", "parallel_scan_log", "matrix_affine_scan", "rotation_recurrence"])
def test_gradcheck_float64(op, make):
    inputs = [x.requires_grad_() for x in make()]
    assert torch.autograd.gradcheck(op, inputs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_half_inputs_accumulate_in_float32(dtype):
    a, b = _linear_inputs(2, 100, 8, dtype)
    A, Bc = mingru.linear_scan(a, b)
    assert A.dtype == Bc.dtype == dtype
    ref_A, ref_B = naive.linear_scan_naive(a, b)
    # one rounding at the store: relative error of the half format, not T of them
    tol = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    torch.testing.assert_close(Bc.double(), ref_B, atol=tol * 4, rtol=tol)
    h = mingru.parallel_scan_log(*_log_inputs(2, 50, 4, dtype))
    assert h.dtype == dtype


@pytest.mark.parametrize("combine,make", [
    (scans.scalar_combine, lambda g: (torch.randn(4, generator=g), torch.randn(4, generator=g))),
    (scans.matrix_combine, lambda g: (torch.randn(3, 3, generator=g), torch.randn(3, 2, generator=g))),
    (scans.log_combine, lambda g: (torch.randn(4, generator=g), torch.randn(4, generator=g))),
], ids=["scalar", "matrix", "log"])
def test_monoid_is_associative(combine, make):
    g = torch.Generator().manual_seed(0)
    x, y, z = (tuple(t.double() for t in make(g)) for _ in range(3))
    left, right = combine(combine(x, y), z), combine(x, combine(y, z))
    for l, r in zip(left, right):
        torch.testing.assert_close(l, r)


def test_matrix_monoid_is_not_commutative():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 3, generator=g), torch.randn(3, 1, generator=g))
    y = (torch.randn(3, 3, generator=g), torch.randn(3, 1, generator=g))
    assert not torch.allclose(scans.matrix_combine(x, y)[0], scans.matrix_combine(y, x)[0])


@pytest.mark.parametrize("op,make", [
    (mingru.linear_recurrence, lambda: _linear_inputs(0, 200, 3)),
    (mingru.parallel_scan_log, lambda: _log_inputs(0, 200, 3)),
    (mingru.matrix_affine_scan, lambda: _matrix_inputs(0, 200, 2, 3, 1)),
], ids=["linear_recurrence", "parallel_scan_log", "matrix_affine_scan"])
def test_empty_batch_spanning_chunks(op, make):
    outs = op(*make())
    for o in outs if isinstance(outs, tuple) else (outs,):
        assert o.shape[:2] == (0, 200)


def test_nan_propagates():
    a, b = _linear_inputs(1, 6, 2)
    b[0, 2, 0] = float("nan")
    _, Bc = mingru.linear_scan(a, b)
    assert Bc[0, :2].isfinite().all() and Bc[0, 2:, 0].isnan().all() and Bc[0, :, 1].isfinite().all()


@pytest.mark.parametrize("T", [1, 5, 16, 17, 100])
def test_identity_padding_rounds_equal_the_slicing_rounds(T):
    """hillis_steele/chunked_scan with the scalar identity give the same values and gradients, bit for bit."""
    gen = torch.Generator().manual_seed(T)
    a, b = torch.randn(2, T, 3, generator=gen), torch.randn(2, T, 3, generator=gen)
    results = []
    for identity in (None, scans.SCALAR_IDENTITY):
        x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
        A, Bc = scans.chunked_scan((x, y), scans.scalar_combine, identity=identity)
        (A * 2 + Bc).sum().backward()
        results.append((A, Bc, x.grad, y.grad))
    for old, new in zip(*results):
        assert torch.equal(old, new)
