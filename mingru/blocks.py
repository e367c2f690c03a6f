"""Residual blocks and stacks around one mixer each, with mingru-scans 0.2.0's API and layout.

A block is pre-norm: x + dropout(mixer(LN x)), then x + MLP(LN x) (Linear, GELU, Dropout, Linear;
`mlp_expansion=0` leaves the MLP out). Both `forward` and `step` return (output, state): the
mixer's last state, (B, 1, d_model) from `forward` and (B, d_model) from `step`, or the flattened
matrix state of a mixer that carries one (`carries_matrix_state`, e.g. DeltaMinGRU). Passing the
returned state to the next call continues the sequence (detach it for truncated backprop).
"""
import importlib
import warnings

import torch
from torch import nn

from mingru.decay import DECAY_KWARGS, check_delta_t_pairing
from mingru.validate import check_input, check_sizes

# mixer name -> ("module:class", whether the class takes learnable_h0)
MIXERS = {
    "log": ("mingru.mixers:MinGRU", True),
    "signed": ("mingru.mixers:SignedMinGRU", True),
    "rotation": ("mingru.mixers:RotationMinGRU", False),
    "givens": ("mingru.mixers:GivensMinGRU", False),
    "delta": ("mingru.delta:DeltaMinGRU", False),  # imported only when asked for
}


def mixer_class(name):
    """The mixer class registered under `name` (one of MIXERS)."""
    if not isinstance(name, str) or name not in MIXERS:
        raise ValueError(f"mixer must be one of {sorted(MIXERS)}, got {name!r}")
    module, cls = MIXERS[name][0].split(":")
    return getattr(importlib.import_module(module), cls)


def _carries_matrix_state(mixer):
    return getattr(mixer, "carries_matrix_state", False)


class MinGRUBlock(nn.Module):
    """LN -> mixer -> +x, then LN -> MLP -> +x. `learnable_h0` reaches only the log and signed mixers."""

    def __init__(self, d_model, mlp_expansion=4, dropout=0.0, learnable_h0=False, mixer="log",
                 mixer_kwargs=None):
        super().__init__()
        check_sizes("MinGRUBlock", d_model=d_model)
        if not isinstance(mlp_expansion, int) or isinstance(mlp_expansion, bool):
            raise TypeError(f"MinGRUBlock: mlp_expansion must be an int (hidden width = mlp_expansion * d_model; "
                            f"0 or less: no MLP), got {mlp_expansion!r}")
        _check_kwargs("MinGRUBlock", mixer_kwargs)
        cls = mixer_class(mixer)
        kwargs = dict(mixer_kwargs or {})
        if MIXERS[mixer][1]:
            kwargs["learnable_h0"] = learnable_h0
        self.norm1 = nn.LayerNorm(d_model)
        self.mingru = cls(d_model, d_model, **kwargs)
        self.drop = nn.Dropout(dropout)
        self.norm2 = nn.LayerNorm(d_model) if mlp_expansion > 0 else None
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_expansion * d_model), nn.GELU(), nn.Dropout(dropout),
            nn.Linear(mlp_expansion * d_model, d_model)) if mlp_expansion > 0 else None

    def _mlp(self, x):
        return x if self.mlp is None else x + self.mlp(self.norm2(x))

    def forward(self, x, h_0=None, delta_t=None):
        """x (B, T, d_model) -> (output (B, T, d_model), state for the next call)."""
        check_input("MinGRUBlock", x, self, False, self.norm1.normalized_shape[0], "d_model")
        if _carries_matrix_state(self.mingru):
            h, state = self.mingru(self.norm1(x), h_0, delta_t, return_state=True)
        else:
            h = self.mingru(self.norm1(x), h_0, delta_t)
            state = h[:, -1:] if h.shape[1] else h_0  # an empty chunk leaves the state as it was
        return self._mlp(x + self.drop(h)), state

    @torch.no_grad()
    def step(self, x_t, h_prev=None, delta_t=None):
        """x_t (B, d_model) -> (output (B, d_model), new state)."""
        check_input("MinGRUBlock", x_t, self, True, self.norm1.normalized_shape[0], "d_model")
        if _carries_matrix_state(self.mingru):
            y, state = self.mingru.step(self.norm1(x_t), h_prev, delta_t)
        else:
            y = state = self.mingru.step(self.norm1(x_t), h_prev, delta_t)
        return self._mlp(x_t + y), state


def _check_kwargs(owner, mixer_kwargs):
    if mixer_kwargs is not None and not isinstance(mixer_kwargs, dict):
        raise TypeError(f"{owner}: mixer_kwargs must be a dict of keyword arguments or None, "
                        f"got {type(mixer_kwargs).__name__}")


def _mixer_plan(mixer, mixer_kwargs, n_layers):
    """One (name, kwargs) per layer. A str mixer takes flat kwargs; a list takes kwargs keyed by name."""
    _check_kwargs("MinGRUStack", mixer_kwargs)
    if isinstance(mixer, str):
        clash = sorted(set(mixer_kwargs or {}) & set(MIXERS))
        if clash:
            raise ValueError(f"mixer_kwargs for mixer={mixer!r} must be that mixer's keywords; keys "
                             f"{clash} are mixer names, the form used when mixer is a list")
        return [(mixer, mixer_kwargs)] * n_layers
    if not isinstance(mixer, list):
        raise TypeError(f"mixer must be a str or a list of n_layers strs, got {type(mixer).__name__}")
    if len(mixer) != n_layers:
        raise ValueError(f"mixer must list n_layers = {n_layers} names, got {len(mixer)}")
    unknown = sorted({m for m in mixer if m not in MIXERS})
    if unknown:
        raise ValueError(f"mixer names {unknown} are not among {sorted(MIXERS)}")
    stray = sorted(set(mixer_kwargs or {}) - set(mixer))
    if stray:
        raise ValueError(f"with a list mixer, mixer_kwargs maps a listed mixer name to its keywords; "
                         f"keys {stray} name no mixer in {mixer}")
    return [(m, (mixer_kwargs or {}).get(m)) for m in mixer]


class MinGRUStack(nn.Module):
    """in_proj -> n_layers MinGRUBlocks -> LayerNorm; `forward` and `step` return (output, states).

    `mixer` is one name for every block or a list with one name per block (then `mixer_kwargs`
    is keyed by name). `decay_layers="last"` keeps the decay keywords for the final block only.
    `delta_t` goes to the blocks whose mixer decays; passing it when none does is a ValueError.
    """

    def __init__(self, input_size, d_model, n_layers, mlp_expansion=4, dropout=0.0,
                 learnable_h0=False, mixer="log", mixer_kwargs=None, decay_layers="all"):
        super().__init__()
        check_sizes("MinGRUStack", input_size=input_size, d_model=d_model, n_layers=n_layers)
        if decay_layers not in ("all", "last"):
            raise ValueError(f"decay_layers must be 'all' or 'last', got {decay_layers!r}")
        self.decay_layers = decay_layers
        plan = _mixer_plan(mixer, mixer_kwargs, n_layers)
        if decay_layers == "last":
            plan = [(m, {k: v for k, v in (kw or {}).items() if k not in DECAY_KWARGS})
                    if i < n_layers - 1 else (m, kw) for i, (m, kw) in enumerate(plan)]
        n_rot = sum(m == "rotation" for m, _ in plan)
        if n_rot > 1:
            warnings.warn(f"{n_rot} 'rotation' blocks: the straight-through gradient of the "
                          "snapped angles can compound from layer to layer", stacklevel=2)
        self.input_size = input_size
        self.in_proj = nn.Linear(input_size, d_model) if input_size != d_model else nn.Identity()
        self.blocks = nn.ModuleList(MinGRUBlock(d_model, mlp_expansion, dropout, learnable_h0, m, kw)
                                    for m, kw in plan)
        self.norm_out = nn.LayerNorm(d_model)

    def init_state(self):
        """A fresh state: one None per block (each mixer then starts from its default state)."""
        return [None] * len(self.blocks)

    def _run(self, x, state, delta_t, call, step):
        check_input("MinGRUStack", x, self, step, self.input_size)
        decays = [block.mingru.decay is not None for block in self.blocks]
        if not any(decays):
            check_delta_t_pairing(None, delta_t)
        state = self.init_state() if state is None else state
        if not isinstance(state, (list, tuple)):
            raise TypeError(f"state must be a list of n_layers = {len(self.blocks)} entries (from init_state, "
                            f"forward or step), got {type(state).__name__}")
        if len(state) != len(self.blocks):
            raise ValueError(f"state must be a list of n_layers = {len(self.blocks)} entries, "
                             f"got {len(state)}")
        x, new_state = self.in_proj(x), []
        for block, h, decays_here in zip(self.blocks, state, decays):
            x, h = call(block, x, h, delta_t if decays_here else None)
            new_state.append(h)
        return self.norm_out(x), new_state

    def forward(self, x, state=None, delta_t=None):
        """x (B, T, input_size) -> (output (B, T, d_model), per-block states for the next call)."""
        return self._run(x, state, delta_t, MinGRUBlock.__call__, False)

    @torch.no_grad()
    def step(self, x_t, state, delta_t=None):
        """x_t (B, input_size) and the state from init_state/step -> (output (B, d_model), state)."""
        return self._run(x_t, state, delta_t, MinGRUBlock.step, True)
