"""The minGRU family of recurrent mixers: one parallel `forward`, one sequential `step` each.

Every mixer projects x to a transition A_t and an injection B_t and runs h_t = A_t h_{t-1} + B_t
through the states-only op of its family; `step` applies the same recurrence once.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from mingru import ops, scans


def g(x):
    """minGRU's positive candidate activation: x + 1/2 for x >= 0, sigmoid(x) below."""
    return torch.where(x >= 0, x + 0.5, torch.sigmoid(x))


def log_g(x):
    return torch.where(x >= 0, torch.log(F.relu(x) + 0.5), -F.softplus(-x))


class _Mixer(nn.Module):
    def __init__(self, input_size, hidden_size, n_proj):
        super().__init__()
        self.input_size, self.hidden_size = input_size, hidden_size
        self.proj = nn.Linear(input_size, n_proj)

    def _check(self, x, h, batch_dims):
        name = type(self).__name__
        if x.dim() != batch_dims + 1 or x.shape[-1] != self.input_size:
            want = "(B, T, input_size)" if batch_dims == 2 else "(B, input_size)"
            raise ValueError(f"{name}: x must have shape {want} with input_size = {self.input_size}, "
                             f"got {tuple(x.shape)}")
        if h is not None and (h.shape != (x.shape[0], self.hidden_size)):
            raise ValueError(f"{name}: the initial state must have shape (B, hidden_size) = "
                             f"({x.shape[0]}, {self.hidden_size}), got {tuple(h.shape)}")


class MinGRU(_Mixer):
    """h_t = (1 - z_t) h_{t-1} + z_t g(h~_t), run in log space by parallel_scan_log. States stay > 0."""

    def __init__(self, input_size, hidden_size):
        super().__init__(input_size, hidden_size, 2 * hidden_size)

    def forward(self, x, h_0=None):
        self._check(x, h_0, 2)
        k, cand = self.proj(x).chunk(2, dim=-1)
        log_coeffs = -F.softplus(k)                  # log(1 - z)
        log_values = -F.softplus(-k) + log_g(cand)   # log z + log g(h~)
        log_h0 = (torch.full_like(log_values[:, :1], -math.inf) if h_0 is None
                  else _positive_log(h_0).unsqueeze(1))
        return ops.parallel_scan_log(log_coeffs, torch.cat([log_h0, log_values], dim=1))

    def step(self, x_t, h_prev=None):
        self._check(x_t, h_prev, 1)
        k, cand = self.proj(x_t).chunk(2, dim=-1)
        z = torch.sigmoid(k)
        h_prev = torch.zeros_like(z) if h_prev is None else h_prev
        return (1 - z) * h_prev + z * g(cand)


def _positive_log(h):
    if (h < 0).any():
        raise ValueError("MinGRU: h_0 must be >= 0 (the log-space scan carries log h); got negative entries")
    return h.log()


class SignedMinGRU(_Mixer):
    """Signed scalar transitions a_t = tanh(.) in (-1, 1), injection (1 - |a_t|) h~_t; linear_recurrence."""

    def __init__(self, input_size, hidden_size):
        super().__init__(input_size, hidden_size, 2 * hidden_size)

    def _coeffs(self, x):
        pre_a, cand = self.proj(x).chunk(2, dim=-1)
        a = torch.tanh(pre_a)
        return a, (1 - a.abs()) * cand

    def forward(self, x, h_0=None):
        self._check(x, h_0, 2)
        return ops.linear_recurrence(*self._coeffs(x), h_0)

    def step(self, x_t, h_prev=None):
        self._check(x_t, h_prev, 1)
        a, b = self._coeffs(x_t)
        return b if h_prev is None else a * h_prev + b


class GivensMinGRU(_Mixer):
    """Block rotations: each k-block turns by `rounds` brick-wall Givens rounds and decays.

    A_t = gamma_t G_t (G_t a product of 2*rounds layers of k/2 plane rotations, gamma_t in (0, 1)),
    B_t = (1 - gamma_t) h~_t. fused=True forms G_t inside the angle-fused kernel; fused=False builds
    the dense k x k transitions and runs matrix_recurrence (the generic path).
    """

    def __init__(self, input_size, hidden_size, k=8, rounds=3, fused=True, layers=None):
        if k < 2 or k % 2 or hidden_size % k:
            raise ValueError(f"{type(self).__name__}: k must be even and divide hidden_size = "
                             f"{hidden_size}, got k = {k}")
        self.k, self.n, self.fused = k, hidden_size // k, fused
        self.layers = 2 * rounds if layers is None else layers
        n_angles = self.n * self.layers * (k // 2)
        super().__init__(input_size, hidden_size, n_angles + self.n + hidden_size)

    def _coeffs(self, x):
        lead = x.shape[:-1]
        split = [self.n * self.layers * (self.k // 2), self.n, self.hidden_size]
        angles, pre_decay, cand = self.proj(x).split(split, dim=-1)
        angles = angles.reshape(*lead, self.n, self.layers, self.k // 2)
        decay = torch.sigmoid(pre_decay)
        u = (1 - decay).unsqueeze(-1) * cand.reshape(*lead, self.n, self.k)
        return angles, decay, u

    def forward(self, x, h_0=None):
        self._check(x, h_0, 2)
        angles, decay, u = self._coeffs(x)
        h0 = None if h_0 is None else h_0.reshape(-1, self.n, self.k)
        if self.fused:
            h = ops.rotation_recurrence(angles, decay, u, h0)
        else:
            h0 = None if h0 is None else h0.unsqueeze(-1)
            h = ops.matrix_recurrence(scans.givens_matrices(angles, decay), u.unsqueeze(-1), h0)
        return h.reshape(*x.shape[:2], self.hidden_size)

    def step(self, x_t, h_prev=None):
        self._check(x_t, h_prev, 1)
        angles, decay, u = self._coeffs(x_t)
        if h_prev is None:
            return u.reshape(-1, self.hidden_size)
        M = scans.givens_matrices(angles, decay)
        h = M @ h_prev.reshape(-1, self.n, self.k, 1) + u.unsqueeze(-1)
        return h.reshape(-1, self.hidden_size)


class RotationMinGRU(GivensMinGRU):
    """2x2 rotation-times-decay transitions: GivensMinGRU with k = 2 and a single rotation layer."""

    def __init__(self, input_size, hidden_size, fused=True):
        if hidden_size % 2:
            raise ValueError(f"RotationMinGRU: hidden_size must be even, got {hidden_size}")
        super().__init__(input_size, hidden_size, k=2, fused=fused, layers=1)
