"""The eager CPU forms with hand-written backwards against the float64 sequential loops: the small
matrix recurrence (k <= scans.SMALL_K, v = 1), the k = 2 rotation recurrence built straight into
its layout, and the delta rule's carried chain."""
import pytest
import torch
import torch.nn.functional as F

from gradutil import outputs_and_grads
from mingru import naive, scans
from mingru.delta import delta_rule_chunked, delta_rule_recurrent

pytestmark = pytest.mark.usefixtures("eager_mode")

f64 = torch.float64
TS = [1, 2, 5, 16, 17, 64, 100, 257]  # one chunk, whole chunks, a ragged last chunk


def _close(fn, ref, inputs, atol=1e-10):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    cot = [torch.randn(o.shape, generator=g, dtype=f64) for o in outs]
    got, got_grads = outputs_and_grads(fn, inputs, cot)
    want, want_grads = outputs_and_grads(ref, inputs, cot)
    for a, b in zip(got + got_grads, want + want_grads):
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-10)


@pytest.mark.parametrize("T", TS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("with_h0", [False, True], ids=["zero-h0", "h0"])
def test_small_matrix_recurrence(T, k, with_h0):
    g = torch.Generator().manual_seed(T * 10 + k)
    A = 0.9 * torch.randn(2, T, 3, k, k, generator=g, dtype=f64) / k ** 0.5
    X = torch.randn(2, T, 3, k, 1, generator=g, dtype=f64)
    h0 = [torch.randn(2, 3, k, 1, generator=g, dtype=f64)] if with_h0 else []
    _close(scans.matrix_recurrence, naive.matrix_recurrence_naive, [A, X, *h0])


@pytest.mark.parametrize("T", TS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("with_scale", [False, True], ids=["no-scale", "scale"])
@pytest.mark.parametrize("with_h0", [False, True], ids=["zero-h0", "h0"])
def test_plane_rotation_recurrence(T, with_scale, with_h0):
    """k = 2, one layer: the transitions built by columns equal rotation_matrices' entries."""
    g = torch.Generator().manual_seed(T)
    angles = 3 * torch.randn(2, T, 4, 1, 1, generator=g, dtype=f64)
    decay, u = torch.rand(2, T, 4, generator=g, dtype=f64), torch.randn(2, T, 4, 2, generator=g, dtype=f64)
    extra = {"h0": torch.randn(2, 4, 2, generator=g, dtype=f64)} if with_h0 else {}
    if with_scale:
        extra["scale"] = 2 * torch.rand(2, T, 4, generator=g, dtype=f64) - 1

    def ref(angles, decay, u, h0=None, scale=None):
        M = scans.rotation_matrices(angles, decay, scale)
        return naive.matrix_recurrence_naive(M, u.unsqueeze(-1), None if h0 is None else h0.unsqueeze(-1)).squeeze(-1)

    def keywords(fn):
        return lambda angles, decay, u, *rest: fn(angles, decay, u, **dict(zip(extra, rest)))

    _close(keywords(scans.rotation_recurrence), keywords(ref), [angles, decay, u, *extra.values()])


def test_small_matrix_recurrence_float32_matches_float64():
    g = torch.Generator().manual_seed(0)
    A = 0.9 * torch.randn(3, 300, 5, 2, 2, generator=g) / 2 ** 0.5
    X, h0 = torch.randn(3, 300, 5, 2, 1, generator=g), torch.randn(3, 5, 2, 1, generator=g)
    got = scans.matrix_recurrence(A, X, h0)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), naive.matrix_recurrence_naive(A.double(), X.double(), h0.double()),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("nh", [1, 2], ids=["nh1", "nh2"])
@pytest.mark.parametrize("chunk_size", [3, 13, 64], ids=lambda c: f"C{c}")
def test_carried_chain_from_zero_state(chunk_size, nh, gated):
    """The carried form with h_0 None (the mixer's default) and several chunks equals the recurrence."""
    g = torch.Generator().manual_seed(chunk_size)
    B, T, H, d_k, d_v = 2, 13, 3, 5, 4
    q = torch.randn(B, T, H, d_k, generator=g, dtype=f64)
    k = F.normalize(torch.randn(B, T, nh, H, d_k, generator=g, dtype=f64), dim=-1)
    v = torch.randn(B, T, nh, H, d_v, generator=g, dtype=f64)
    beta = 2 * torch.rand(B, T, nh, H, generator=g, dtype=f64)
    log_gamma = [-torch.rand(B, T, H, generator=g, dtype=f64)] if gated else []

    def call(fn, **options):
        return lambda q, k, v, beta, log_gamma=None: fn(q, k, v, beta, log_gamma=log_gamma, **options)

    _close(call(delta_rule_chunked, chunk_size=chunk_size, across="carry"), call(delta_rule_recurrent),
           [q, k, v, beta, *log_gamma])
