"""The minGRU family of recurrent mixers, with mingru-scans 0.2.0's API and checkpoint layout.

Each mixer maps x (B, T, input_size) to the states h (B, T, hidden_size) of one recurrence
h_t = A_t h_{t-1} + B_t, run in parallel over T by a public op of `mingru.ops` (so the Triton
kernels serve it on CUDA); `step` applies the same recurrence once, without autograd, to
(B, input_size) and a state (B, hidden_size). `forward` takes the initial state as (B, 1, hidden_size), so a chunked
caller passes `h_0 = previous_output[:, -1:]`. With `decay`, `delta_t` (B, T) in `forward` or (B,)
in `step` scales A_t by gamma_t = exp(-lambda f(delta_t)) (see `mingru.decay`).
Parameter names and shapes are the published ones: one nn.Linear per projection.

Checks mingru-scans does not make (each a TypeError or ValueError naming the argument): a given
state must be a floating-point tensor of x's dtype (any floating dtype under autocast) on x's
device; delta_t must be real and on the mixer's device (it is cast to float32, or float64 for a
float64 module); the switches `coupled` and `fused` must be bools, `snap` a tuple of positive ints.
"""
import torch
from torch import nn

from mingru import dispatch, ops, scans
from mingru.decay import DecayMixin
from mingru.scans import g
from mingru.validate import check_flag, check_input, check_sizes, check_state, data_checkable


def _linears(input_size, sizes, bias):
    return [nn.Linear(input_size, n, bias=bias) for n in sizes]


class _Mixer(DecayMixin, nn.Module):
    """Shared plumbing: size checks, the input projections, state shapes, decay."""

    def __init__(self, input_size, hidden_size):
        super().__init__()
        check_sizes(type(self).__name__, input_size=input_size, hidden_size=hidden_size)
        self.input_size, self.hidden_size = input_size, hidden_size

    def _project(self, x, *linears):
        """The outputs of `linears` on x, one matmul each: a split of one matmul over the stacked
        weights would keep its whole output alive while any piece is saved for the backward, and
        its backward would concatenate every piece's gradient, raising the training step's peak
        memory by about one stacked output (results/seed.md has the measured peaks)."""
        return [lin(x) for lin in linears]

    def _check_x(self, x, step):
        check_input(type(self).__name__, x, self, step, self.input_size)

    def _state(self, h, x, step, default):
        """The initial state, checked: (B, 1, H) for forward, (B, H) for step; `default(x)` if None.

        A default is made on x's device: a host tensor copied over would make every call wait for
        the GPU (torch synchronizes a blocking host-to-device copy)."""
        B, H = x.shape[0], self.hidden_size
        if h is None:
            h = default(x).to(dtype=x.dtype)
            return h.expand(B, 1, H)[:, 0] if step else h.expand(B, 1, H)
        want = (B, H) if step else (B, 1, H)
        if not isinstance(h, torch.Tensor) or tuple(h.shape) != want:
            arg = "h_prev" if step else "h_0"
            sym = "(B, hidden_size)" if step else "(B, 1, hidden_size)"
            raise ValueError(f"{type(self).__name__}: {arg} must have shape {sym} = {want}, "
                             f"got {tuple(getattr(h, 'shape', ())) or type(h).__name__}")
        check_state(type(self).__name__, "h_prev" if step else "h_0", h, x)
        return h

    def _dt(self, delta_t, x):
        return self._prepare_decay(delta_t, x.shape[:-1])

    def extra_repr(self):
        return f"input_size={self.input_size}, hidden_size={self.hidden_size}"


class MinGRU(_Mixer):
    """h_t = gamma_t (1 - z_t) h_{t-1} + z_t g(h~_t), z = sigmoid(linear_z x), h~ = linear_h x.

    `gated_recurrence` runs it from the pre-activations k and h~ (on CUDA one kernel computes the
    gates as it loads them); with decay, `linear_recurrence` runs it on a = gamma (1 - z), b = z g(h~)
    (`scans.gates`). Linear space needs no logs here: 0 < a < 1, so every state is a weighted average
    of h0 and g values. The default initial state is g(0) = 0.5, or g(h0_pre) with `learnable_h0`;
    a given h_0 must be >= 0 (a real state).
    """

    def __init__(self, input_size, hidden_size, bias=True, learnable_h0=False, decay=None,
                 decay_rate=1.0, log1p_delta=False):
        super().__init__(input_size, hidden_size)
        self.linear_z, self.linear_h = _linears(input_size, [hidden_size] * 2, bias)
        self.h0_pre = nn.Parameter(torch.zeros(1, 1, hidden_size)) if learnable_h0 else None
        self._init_decay(decay, decay_rate, log1p_delta, hidden_size)

    def _default_h0(self, x):
        return g(self.h0_pre) if self.h0_pre is not None else x.new_full((1, 1, self.hidden_size), 0.5)

    def forward(self, x, h_0=None, delta_t=None):
        self._check_x(x, step=False)
        given = h_0 is not None
        h_0 = self._state(h_0, x, False, self._default_h0)
        if given:
            _check_nonnegative(h_0)
        dt = self._dt(delta_t, x)
        if dt is None and _stacks(x):  # one matmul; the kernel adds the biases and computes the gates
            kc, bias = _stacked(x, self.linear_z, self.linear_h)
            return ops.gated_recurrence_stacked(kc, h_0[:, 0].to(kc.dtype), bias)
        k, cand = self._project(x, self.linear_z, self.linear_h)
        h_0 = h_0[:, 0].to(k.dtype)
        if dt is None:
            return ops.gated_recurrence(k, cand, h_0)
        a, b = scans.gates(k, cand)
        return ops.linear_recurrence((a * self._decay_gamma(dt)).to(k.dtype), b, h_0)

    @torch.no_grad()
    def step(self, x_t, h_prev=None, delta_t=None):
        self._check_x(x_t, step=True)
        h_prev = self._state(h_prev, x_t, True, self._default_h0)
        k, cand = self._project(x_t, self.linear_z, self.linear_h)
        z = torch.sigmoid(k)
        a = 1 - z
        dt = self._dt(delta_t, x_t)
        if dt is not None:
            a = a * self._decay_gamma(dt)
        return a * h_prev + z * g(cand)


def _stacks(x):
    """Whether MinGRU and SignedMinGRU run their projections as one matmul: where the scan's kernel
    runs (it reads k | cand (| s) in place). The eager scan and the sequence-parallel route take
    them apart."""
    return not dispatch.runs_eager(x) and dispatch.sequence_parallel_route is None


def stacked_params(*linears):
    """(weight, bias) of `linears` stacked along their outputs (bias None without), for one matmul
    that computes their outputs side by side. The parameters stay separate, as the checkpoint has
    them."""
    weight = torch.cat([lin.weight for lin in linears])
    return weight, None if linears[0].bias is None else torch.cat([lin.bias for lin in linears])


def _stacked(x, *linears):
    """(kc, bias): the outputs of `linears` on x side by side in the last dim, from one matmul over
    their stacked weights, and the bias the scan still has to add (None when it has none to add).

    In float32 the matmul leaves the biases out and the scan adds them: its backward sums the bias's
    gradient as it goes, where the matmul's would reduce the whole output gradient once more. In a
    16-bit dtype (or under autocast to one) the matmul adds them before its output is rounded:
    rounding x W first moves a pre-activation near 0 by up to half a unit in the last place of |x W|,
    enough to flip its sign, and MinGRU's g has a slope of 1/4 below 0 and 1 above, so each flip
    changes that step's gradient fourfold (measured: weight gradients several times farther from
    float64 than the eager path's)."""
    weight, bias = stacked_params(*linears)
    if bias is not None and _matmul_dtype(x).itemsize < 4:
        return nn.functional.linear(x, weight, bias), None
    kc = nn.functional.linear(x, weight)
    return kc, None if bias is None else bias.to(kc.dtype)  # autocast: kc's dtype


def _matmul_dtype(x):
    """The dtype a matmul on x returns: autocast's where it is on for x's device, else x's."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


def _check_nonnegative(h_0):
    """MinGRU's states are positive: a negative h_0 is a pre-activation passed by mistake."""
    if data_checkable(h_0):
        if (h_0 < 0).any():
            raise ValueError("MinGRU: h_0 must be a non-negative state (an output of forward or "
                             "step), got negative entries")
    else:  # checked on the device, without a host sync or a graph break
        torch._assert_async((h_0 >= 0).all(), "MinGRU: h_0 must be a non-negative state")


class SignedMinGRU(_Mixer):
    """h_t = a_t h_{t-1} + z_t h~_t, a_t = gamma_t tanh(linear_s x) in (-1, 1), z = sigmoid(linear_z x).

    `coupled=True` uses a_t = gamma_t (1 - z_t) tanh(linear_s x). Initial state 0 (or the learned h0).
    Without decay, where the kernels run, `signed_recurrence_stacked` runs it on one matmul of the
    three projections (the kernel adds the biases and computes the gates); otherwise
    `linear_recurrence` on the gates (`scans.signed_gates`).
    """

    def __init__(self, input_size, hidden_size, bias=True, learnable_h0=False, coupled=False,
                 decay=None, decay_rate=1.0, log1p_delta=False):
        super().__init__(input_size, hidden_size)
        check_flag("SignedMinGRU", coupled=coupled)
        self.coupled = coupled
        self.linear_z, self.linear_h, self.linear_s = _linears(input_size, [hidden_size] * 3, bias)
        self.h0 = nn.Parameter(torch.zeros(1, 1, hidden_size)) if learnable_h0 else None
        self._init_decay(decay, decay_rate, log1p_delta, hidden_size)

    def _default_h0(self, x):
        return self.h0 if self.h0 is not None else x.new_zeros(1, 1, self.hidden_size)

    def _coeffs(self, x, dt):
        a, b = scans.signed_gates(*self._project(x, self.linear_z, self.linear_h, self.linear_s), self.coupled)
        if dt is not None:
            a = a * self._decay_gamma(dt)
        return a, b

    def forward(self, x, h_0=None, delta_t=None):
        self._check_x(x, step=False)
        h_0 = self._state(h_0, x, False, self._default_h0)
        dt = self._dt(delta_t, x)
        if dt is None and _stacks(x):  # one matmul; the kernel adds the biases and computes the gates
            kcs, bias = _stacked(x, self.linear_z, self.linear_h, self.linear_s)
            return ops.signed_recurrence_stacked(kcs, h_0[:, 0].to(kcs.dtype), bias, self.coupled)
        a, b = self._coeffs(x, dt)
        return ops.linear_recurrence(a.to(b.dtype), b, h_0[:, 0].to(b.dtype))

    @torch.no_grad()
    def step(self, x_t, h_prev=None, delta_t=None):
        self._check_x(x_t, step=True)
        h_prev = self._state(h_prev, x_t, True, self._default_h0)
        a, b = self._coeffs(x_t, self._dt(delta_t, x_t))
        return a * h_prev + b

    def extra_repr(self):
        return super().extra_repr() + f", coupled={self.coupled}"


class _BlockMixer(_Mixer):
    """Mixers whose state is n_blocks k-vectors, h_t = M_t h_{t-1} + z_t h~_t per block.

    The initial state is the learned parameter h0 (1, 1, hidden_size), drawn as 0.5 * N(0, 1).
    """

    def _default_h0(self, x):
        return self.h0

    def _blocks(self, t):
        return t.reshape(*t.shape[:-1], self.n_blocks, self.k)

    def _injection(self, z_pre, cand):
        return self._blocks(torch.sigmoid(z_pre) * cand)

    def _gamma(self, delta_t, x):
        """gamma per block (..., n_blocks); ones without decay."""
        dt = self._dt(delta_t, x)
        if dt is None:
            return x.new_ones(*x.shape[:-1], self.n_blocks)
        return self._decay_gamma(dt).expand(*x.shape[:-1], self.n_blocks)

    def forward(self, x, h_0=None, delta_t=None):
        self._check_x(x, step=False)
        h_0 = self._state(h_0, x, False, self._default_h0)
        h = self._scan(x, self._blocks(h_0[:, 0]), delta_t)
        return h.reshape(*x.shape[:2], self.hidden_size)

    # Under autocast the projections come out in the autocast dtype while h0, the decay and
    # constant buffers stay float32: every scan input takes the injection's dtype.

    @torch.no_grad()
    def step(self, x_t, h_prev=None, delta_t=None):
        self._check_x(x_t, step=True)
        h_prev = self._state(h_prev, x_t, True, self._default_h0)
        M, b = self._transition(x_t, delta_t)
        h = (M @ self._blocks(h_prev).unsqueeze(-1)).squeeze(-1) + b
        return h.reshape(-1, self.hidden_size)

    def _scan(self, x, h0, delta_t):
        M, b = self._transition(x, delta_t)
        return ops.matrix_recurrence(M.to(b.dtype), b.unsqueeze(-1), h0.to(b.dtype).unsqueeze(-1)).squeeze(-1)


class RotationMinGRU(_BlockMixer):
    """Per 2-block: M_t = gamma_t R(theta_t) diag(1, tanh(linear_u x)), theta = linear_theta x.

    With `snap`, block j's angle is rounded to a multiple of 2 pi / snap[j % len(snap)] in the
    forward pass while its gradient passes straight through. Runs on `rotation_recurrence` (k = 2,
    one layer, scale d = tanh(linear_u x)); `step` builds M.
    """

    def __init__(self, input_size, hidden_size, bias=True, snap=(2, 3, 4, 6), decay=None,
                 decay_rate=1.0, log1p_delta=False):
        super().__init__(input_size, hidden_size)
        if hidden_size % 2:
            raise ValueError(f"RotationMinGRU: hidden_size must be even (n_blocks = hidden_size / 2 "
                             f"planes), got {hidden_size}")
        if snap is not None and (not isinstance(snap, (tuple, list)) or len(snap) == 0 or any(
                not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in snap)):
            raise ValueError(f"RotationMinGRU: snap must be None or a non-empty tuple of positive "
                             f"ints, got {snap!r}")
        self.k, self.n_blocks, self.snap = 2, hidden_size // 2, snap
        n = self.n_blocks
        self.linear_z, self.linear_h, self.linear_theta, self.linear_u = _linears(
            input_size, [hidden_size, hidden_size, n, n], bias)
        self.h0 = nn.Parameter(torch.randn(1, 1, hidden_size) * 0.5)
        if snap is not None:
            steps = [2 * torch.pi / snap[j % len(snap)] for j in range(n)]
            self.register_buffer("snap_step", torch.tensor(steps))
        self._init_decay(decay, decay_rate, log1p_delta, n)

    def _heads(self, x, delta_t):
        """theta (snapped), d = tanh(linear_u x), gamma per block, and the injection."""
        z_pre, cand, theta, u = self._project(x, self.linear_z, self.linear_h, self.linear_theta,
                                              self.linear_u)
        if self.snap is not None:
            theta = theta + (torch.round(theta / self.snap_step) * self.snap_step - theta).detach()
        return theta, torch.tanh(u), self._gamma(delta_t, x), self._injection(z_pre, cand)

    def _transition(self, x, delta_t):
        theta, d, gamma, b = self._heads(x, delta_t)
        return scans.rotation_matrices(theta[..., None, None], gamma, d), b

    def _scan(self, x, h0, delta_t):
        # M = gamma R(theta) diag(1, d) is the angle-fused op's transition with k = 2, one layer and
        # scale d: no (B, T, n, 2, 2) matrices are built, saved or differentiated.
        theta, d, gamma, b = self._heads(x, delta_t)
        return ops.rotation_recurrence(theta[..., None, None].to(b.dtype), gamma.to(b.dtype), b, h0.to(b.dtype),
                                       d.to(b.dtype))

    def extra_repr(self):
        return super().extra_repr() + f", snap={self.snap}"


class GivensMinGRU(_BlockMixer):
    """Per k-block: M_t = gamma_t G_{rounds-1} ... G_0, G_r brick-wall Givens rotations.

    Round r turns the planes (i, i+1 mod k), i = r%2, r%2 + 2, ..., by angles from linear_theta.
    `fused=True` (our one extra keyword) runs `ops.rotation_recurrence`, which builds the
    rotations inside the kernel; `fused=False` builds dense k x k matrices for `matrix_recurrence`.
    """

    def __init__(self, input_size, hidden_size, bias=True, block_size=8, rounds=3, decay=None,
                 decay_rate=1.0, log1p_delta=False, fused=True):
        super().__init__(input_size, hidden_size)
        if not isinstance(block_size, int) or block_size < 2 or block_size % 2:
            raise ValueError(f"GivensMinGRU: block_size must be an even int >= 2, got {block_size!r}")
        if hidden_size % block_size:
            raise ValueError(f"GivensMinGRU: hidden_size ({hidden_size}) must be divisible by "
                             f"block_size ({block_size})")
        check_flag("GivensMinGRU", fused=fused)
        check_sizes("GivensMinGRU", rounds=rounds)
        self.k, self.n_blocks, self.rounds, self.fused = block_size, hidden_size // block_size, rounds, fused
        n_angles = self.n_blocks * rounds * (block_size // 2)
        self.linear_theta, self.linear_z, self.linear_h = _linears(
            input_size, [n_angles, hidden_size, hidden_size], bias)
        self.h0 = nn.Parameter(torch.randn(1, 1, hidden_size) * 0.5)
        for r in range(rounds):  # the plane index buffers are part of the published state_dict
            first = torch.arange(r % 2, block_size, 2)
            self.register_buffer(f"_pi{r}", first)
            self.register_buffer(f"_pj{r}", (first + 1) % block_size)
        self._init_decay(decay, decay_rate, log1p_delta, self.n_blocks)

    def _heads(self, x, delta_t):
        theta, z_pre, cand = self._project(x, self.linear_theta, self.linear_z, self.linear_h)
        angles = theta.unflatten(-1, (self.n_blocks, self.rounds, self.k // 2))
        return angles, self._gamma(delta_t, x), self._injection(z_pre, cand)

    def _transition(self, x, delta_t):
        angles, gamma, b = self._heads(x, delta_t)
        return scans.rotation_matrices(angles, gamma), b

    def _scan(self, x, h0, delta_t):
        if not self.fused:
            return super()._scan(x, h0, delta_t)
        angles, gamma, b = self._heads(x, delta_t)
        return ops.rotation_recurrence(angles.to(b.dtype), gamma.to(b.dtype), b, h0.to(b.dtype))

    def extra_repr(self):
        return super().extra_repr() + f", block_size={self.k}, rounds={self.rounds}, fused={self.fused}"
