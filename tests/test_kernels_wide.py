"""The delta rule's kernels against float64: the wide matrix_recurrence (k, v in WIDE_SIZES), the
unit lower triangular solve and inverse, and delta_rule_chunked running them under MINGRU_SCAN=triton.

Without a GPU they run through the Triton interpreter, so the shapes stay small. Tolerances:
float32 sums k-term products over a few steps, so 1e-5 abs / 1e-4 rel on values of order one.
"""
import pytest
import torch
import torch.nn.functional as F

import mingru
from gradutil import outputs_and_grads
from mingru import naive, scans
from mingru.delta import delta_rule_chunked, delta_rule_recurrent
from mingru.dispatch import ScanFallback, dispatch

wide = pytest.importorskip("mingru.kernels.wide")
from mingru.kernels import triangular  # noqa: E402
pytestmark = pytest.mark.usefixtures("triton_mode")

TOL = dict(atol=1e-5, rtol=1e-4)


def _close(got, want, **tol):
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g.double(), w, **(tol or TOL))


@pytest.mark.parametrize("k,v,T,h0", [(32, 32, 4, True), (64, 32, 3, False), (32, 64, 1, True)])
def test_wide_matrix_recurrence_matches_float64(k, v, T, h0, device):
    g = torch.Generator().manual_seed(k + v + T)
    A = torch.randn(2, T, 3, k, k, generator=g) * (0.6 / k ** 0.5)
    X = torch.randn(2, T, 3, k, v, generator=g)
    inputs = [A, X] + ([torch.randn(2, 3, k, v, generator=g)] if h0 else [])
    cot = [torch.randn(2, T, 3, k, v, generator=g).double()]
    want, want_grads = outputs_and_grads(naive.matrix_recurrence_naive, [x.double() for x in inputs], cot)
    got, got_grads = outputs_and_grads(mingru.matrix_recurrence, [x.to(device) for x in inputs],
                                       [c.to(device) for c in cot])
    _close([x.cpu() for x in got + got_grads], want + want_grads)


def test_wide_matrix_recurrence_bfloat16(device):
    """bfloat16 in and out, float32 inside: within bfloat16's rounding of the float64 result."""
    g = torch.Generator().manual_seed(3)
    A = torch.randn(1, 3, 2, 32, 32, generator=g) * (0.6 / 32 ** 0.5)
    X = torch.randn(1, 3, 2, 32, 32, generator=g)
    got = mingru.matrix_recurrence(A.bfloat16().to(device), X.bfloat16().to(device))
    want = naive.matrix_recurrence_naive(A.bfloat16().double(), X.bfloat16().double())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu().double(), want, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("M", [1, 7, 33, 64])
def test_unit_lower_solve_matches_float64(M, device):
    g = torch.Generator().manual_seed(M)
    L = torch.randn(2, 3, M, M, generator=g) * 0.3 + torch.randn(2, 3, M, M, generator=g).triu() * 5
    R = torch.randn(2, 3, M, 5, generator=g)
    cot = [torch.randn(2, 3, M, 5, generator=g).double()]
    want, want_grads = outputs_and_grads(scans.unit_lower_solve, [L.double(), R.double()], cot)
    run = lambda L, R: dispatch("unit_lower_solve", scans.unit_lower_solve, L, R)  # noqa: E731
    got, got_grads = outputs_and_grads(run, [L.to(device), R.to(device)], [c.to(device) for c in cot])
    # the upper triangle and diagonal of L are never read, so their gradient is zero on both sides
    _close([x.cpu() for x in got + got_grads], want + want_grads)


@pytest.mark.parametrize("M", [1, 7, 33, 64])
def test_unit_lower_inverse_matches_float64(M, device):
    g = torch.Generator().manual_seed(M)
    L = torch.randn(3, M, M, generator=g) * 0.3 + torch.randn(3, M, M, generator=g).triu() * 5
    cot = [torch.randn(3, M, M, generator=g).double()]
    want, want_grads = outputs_and_grads(scans.unit_lower_inverse, [L.double()], cot)
    run = lambda L: dispatch("unit_lower_inverse", scans.unit_lower_inverse, L)  # noqa: E731
    got, got_grads = outputs_and_grads(run, [L.to(device)], [c.to(device) for c in cot])
    _close([x.cpu() for x in got + got_grads], want + want_grads)


def test_unit_lower_solve_declines_outside_its_envelope(device):
    L = torch.zeros(1, triangular.MAX_M + 1, triangular.MAX_M + 1, device=device)
    with pytest.raises(ScanFallback, match="M = 65"):
        triangular.unit_lower_solve(L, torch.ones(1, triangular.MAX_M + 1, 2, device=device))
    with pytest.raises(ScanFallback, match="bfloat16"):
        triangular.unit_lower_solve(L[:, :4, :4].bfloat16(), torch.ones(1, 4, 2, device=device).bfloat16())
    with pytest.raises(ScanFallback, match="M = 65"):
        triangular.unit_lower_inverse(L)


@pytest.mark.parametrize("across", [None, "carry"])
@pytest.mark.parametrize("nh,decay,d_k", [(1, False, 32), (2, True, 32), (1, True, 8)])
def test_delta_rule_on_the_kernels_matches_the_recurrence(nh, decay, d_k, across, device):
    """chunk 8 over T = 19: three chunks (the last ragged) chained by the wide (d_k = 32) or the
    narrow (d_k = 8) matrix_recurrence kernel, every chunk's UT transform by unit_lower_solve; or
    (across="carry") carried chunk by chunk, every chunk's T inverted by unit_lower_inverse."""
    g = torch.Generator().manual_seed(nh + d_k)
    B, T, H = 2, 19, 2
    q = torch.randn(B, T, H, d_k, generator=g)
    k = F.normalize(torch.randn(B, T, nh, H, d_k, generator=g), dim=-1)
    v = torch.randn(B, T, nh, H, d_k, generator=g)
    beta = 2 * torch.rand(B, T, nh, H, generator=g)
    h_0 = torch.randn(B, H, d_k, d_k, generator=g)
    inputs = [q, k, v, beta, h_0] + ([-torch.rand(B, T, H, generator=g)] if decay else [])
    cot = [torch.randn(B, T, H, d_k, generator=g).double(), torch.randn(B, H, d_k, d_k, generator=g).double()]

    def run(fn, **kw):
        return lambda q, k, v, beta, h_0, log_gamma=None: fn(q, k, v, beta, log_gamma, h_0, **kw)

    want, want_grads = outputs_and_grads(run(delta_rule_recurrent), [x.double() for x in inputs], cot)
    got, got_grads = outputs_and_grads(run(delta_rule_chunked, chunk_size=8, across=across), [x.to(device) for x in inputs],
                                       [c.to(device) for c in cot])
    _close([x.cpu() for x in got + got_grads], want + want_grads, atol=5e-5, rtol=1e-4)
