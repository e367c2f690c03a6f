"""Exponential time decay of a mixer's carried state: gamma_t = exp(-lambda * f(delta_t)).

Contract (mingru-scans 0.2.0's, kept exactly so its checkpoints and call sites carry over):

- `decay=None` adds nothing: no parameter, no buffer, and `delta_t` must be omitted.
  `decay="fixed"` registers the scalar buffer `decay_rate_buf` holding lambda = decay_rate;
  `decay="learnable"` registers the parameter `rho` of shape (num_channels,) with
  lambda = softplus(rho), initialised so that lambda == decay_rate. decay_rate must be > 0.
- f(dt) is dt, or log1p(dt) with `log1p_delta=True`. Before f, delta_t is cleaned: NaN -> 0,
  +inf -> POSINF_CAP, -inf and negatives -> 0. On CPU tensors a UserWarning says so, once per
  module; on other devices and inside torch.compile the cleaning is silent (checking would cost
  a host sync or a graph break).
- `delta_t` is given iff decay is on, else ValueError. Its shape is the input's leading shape,
  (B, T) in `forward` and (B,) in `step`, optionally with a trailing size-1 dim; a dim of size 1
  broadcasts.
- A mixer multiplies its transition by gamma before the scan (log-space mixers add
  log gamma = -lambda f(dt) to their log-coefficients), so decay runs through the same scan ops.

Use: subclass `DecayMixin` next to `nn.Module`, call `self._init_decay(...)` as the LAST line of
`__init__` (it draws no random numbers, so the other parameters' initial values do not depend
on the decay setting), then in `forward`/`step` call `dt = self._prepare_decay(delta_t, lead)`
and, when dt is not None, fold `self._decay_log_gamma(dt)` or `self._decay_gamma(dt)` in.
"""
import math
import numbers
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from mingru.validate import data_checkable

DECAY_MODES = (None, "fixed", "learnable")
# Constructor keywords that configure decay; MinGRUStack(decay_layers="last") strips them.
DECAY_KWARGS = ("decay", "decay_rate", "log1p_delta")
# +inf gaps become this finite value: large enough to erase the state, small enough to keep
# lambda * dt finite in float32 for any practical lambda.
POSINF_CAP = 1e10


def check_delta_t_pairing(decay, delta_t):
    """ValueError unless delta_t is given exactly when decay is on."""
    if decay is not None and delta_t is None:
        raise ValueError(f"delta_t is required: this mixer was built with decay={decay!r}; "
                         "pass delta_t of shape (B, T) to forward or (B,) to step")
    if decay is None and delta_t is not None:
        raise ValueError("delta_t was given but this mixer has decay=None; build it with "
                         "decay='fixed' or decay='learnable' to use delta_t")


def normalize_delta_t(delta_t, lead, log1p_delta=False, like=None):
    """Check delta_t against the leading shape `lead` (and, given `like`, its device), clean it and
    apply f; delta_t is cast to float32, or to float64 where `like` is float64 (without `like`,
    integers to the default dtype).

    Returns (dt of shape broadcastable to lead, whether bad entries were seen; CPU only).
    """
    if not isinstance(delta_t, torch.Tensor):
        raise TypeError(f"delta_t must be a torch.Tensor of shape {_shape_str(lead)}, "
                        f"got {type(delta_t).__name__}")
    if delta_t.is_complex():
        raise TypeError(f"delta_t must be real (elapsed times), got {delta_t.dtype}")
    if like is not None and delta_t.device != like.device:
        raise ValueError(f"delta_t is on {delta_t.device} but the mixer is on {like.device}; "
                         "put them on one device")
    if delta_t.dim() == len(lead) + 1 and delta_t.shape[-1] == 1:
        delta_t = delta_t.squeeze(-1)
    if delta_t.dim() != len(lead) or any(s not in (1, n) for s, n in zip(delta_t.shape, lead)):
        raise ValueError(f"delta_t must have shape {_shape_str(lead)} = {tuple(lead)} "
                         f"(or with a trailing size-1 dim), got {tuple(delta_t.shape)}")
    if like is not None:  # float32, or float64 for a float64 module: the precision of the gates' math
        delta_t = delta_t.to(torch.promote_types(like.dtype, torch.float32))
    elif not delta_t.is_floating_point():
        delta_t = delta_t.to(torch.get_default_dtype())
    bad = False
    if data_checkable(delta_t):
        bad = bool(((delta_t < 0) | ~delta_t.isfinite()).any())
    dt = delta_t.nan_to_num(nan=0.0, posinf=POSINF_CAP, neginf=0.0).clamp(min=0)
    return (torch.log1p(dt) if log1p_delta else dt), bad


def _shape_str(lead):
    return "(B, T)" if len(lead) == 2 else "(B,)"


class DecayMixin:
    """Adds the time-decay contract above to an `nn.Module` subclass (listed before nn.Module)."""

    def _init_decay(self, decay, decay_rate, log1p_delta, num_channels):
        """Store the decay setting and register `decay_rate_buf` or `rho` (no random draws)."""
        if decay not in DECAY_MODES:
            raise ValueError(f"decay must be None, 'fixed' or 'learnable', got {decay!r}")
        one = isinstance(decay_rate, torch.Tensor) and decay_rate.numel() == 1
        rate = decay_rate.item() if one else decay_rate
        if decay is not None:
            if not isinstance(rate, numbers.Real) or isinstance(rate, bool):
                raise TypeError(f"decay_rate must be a positive number when decay={decay!r}, got {decay_rate!r}")
            if not (0 < rate < math.inf):
                raise ValueError(f"decay_rate must be > 0 and finite when decay={decay!r}, got {decay_rate!r}")
        self.decay, self.decay_rate, self.log1p_delta = decay, decay_rate, log1p_delta
        self._warned_negative_dt = False
        if decay == "fixed":
            self.register_buffer("decay_rate_buf", torch.full((), float(rate)))
        elif decay == "learnable":
            # softplus^-1(decay_rate), so that lambda starts at decay_rate
            # (in the form that does not overflow for large rates where expm1 would)
            rho0 = math.log(math.expm1(rate)) if rate < 20 else rate + math.log1p(-math.exp(-rate))
            self.rho = nn.Parameter(torch.full((num_channels,), rho0))

    def _decay_lambda(self):
        """lambda >= 0: the scalar buffer (fixed) or softplus(rho) of shape (num_channels,)."""
        return self.decay_rate_buf if self.decay == "fixed" else F.softplus(self.rho)

    def _decay_log_gamma(self, dt):
        """log gamma = -lambda * dt with a trailing channel dim: (..., 1) or (..., num_channels)."""
        return -self._decay_lambda() * dt.unsqueeze(-1)

    def _decay_gamma(self, dt):
        """gamma = exp(-lambda * dt) in (0, 1], shaped like `_decay_log_gamma`."""
        return torch.exp(self._decay_log_gamma(dt))

    def _prepare_decay(self, delta_t, lead):
        """Pairing check, then the cleaned f(delta_t) broadcastable to `lead` (None without decay)."""
        check_delta_t_pairing(self.decay, delta_t)
        if delta_t is None:
            return None
        dt, bad = normalize_delta_t(delta_t, tuple(lead), self.log1p_delta,
                                    self.decay_rate_buf if self.decay == "fixed" else self.rho)
        if bad and not self._warned_negative_dt:
            warnings.warn("delta_t has negative, NaN or infinite entries; they were replaced "
                          f"(NaN, -inf and negatives by 0, +inf by {POSINF_CAP:g})", stacklevel=3)
            self._warned_negative_dt = True
        return dt
