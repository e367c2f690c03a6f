"""Mixers: the parallel forward equals T sequential steps; h_0 chains two halves into one."""
import pytest
import torch

import mingru

MIXERS = [
    ("MinGRU", lambda: mingru.MinGRU(6, 16)),
    ("SignedMinGRU", lambda: mingru.SignedMinGRU(6, 16)),
    ("RotationMinGRU", lambda: mingru.RotationMinGRU(6, 16)),
    ("RotationMinGRU-generic", lambda: mingru.RotationMinGRU(6, 16, fused=False)),
    ("GivensMinGRU-k8", lambda: mingru.GivensMinGRU(6, 16)),
    ("GivensMinGRU-k4-r1-generic", lambda: mingru.GivensMinGRU(6, 16, k=4, rounds=1, fused=False)),
]


@pytest.fixture(params=[m[1] for m in MIXERS], ids=[m[0] for m in MIXERS])
def mixer(request):
    torch.manual_seed(0)
    return request.param()


def test_forward_equals_steps(mixer, eager_mode):
    x = torch.randn(3, 11, 6)
    h, steps = None, []
    for t in range(x.shape[1]):
        h = mixer.step(x[:, t], h)
        steps.append(h)
    torch.testing.assert_close(mixer(x), torch.stack(steps, 1), atol=1e-5, rtol=1e-5)


def test_h0_chains_two_halves(mixer, eager_mode):
    x = torch.randn(2, 10, 6)
    whole = mixer(x)
    first = mixer(x[:, :4])
    second = mixer(x[:, 4:], first[:, -1])
    torch.testing.assert_close(torch.cat([first, second], 1), whole, atol=1e-5, rtol=1e-5)


def test_backward_reaches_every_parameter(mixer, eager_mode):
    mixer(torch.randn(2, 5, 6)).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in mixer.parameters())


def test_fused_and_generic_paths_agree(eager_mode):
    torch.manual_seed(0)
    fused, generic = mingru.GivensMinGRU(6, 16, k=4), mingru.GivensMinGRU(6, 16, k=4, fused=False)
    generic.load_state_dict(fused.state_dict())
    x = torch.randn(2, 9, 6)
    torch.testing.assert_close(fused(x), generic(x))
