"""Every use the harnesses make of the kernels' internals, in one place: the test override hook
that forces a layout, the planner's choice, and the switch that lifts the IEEE guard of tl.dot.

The kernel modules are imported only when a function here is called (`import mingru` never
imports Triton).
"""
from typing import NamedTuple


class Layout(NamedTuple):
    chunk: int     # time steps a program loads and combines together (the planner's tile)
    segments: int  # programs along time




def forced_layout(chunk=0, segments=0):
    """Context manager: the diagonal kernels use tile length `chunk` (1: the sequential walk) and
    `segments` time segments (0 leaves either to the planner)."""
    from mingru.kernels import layout
    return layout.forced_layout(tile=chunk, segments=segments)


def diagonal_plan(B, T, D, device=None, sms=None):
    """The diagonal planner's forward layout for a (B, T, D) problem, as (chunk, segments).

    `sms` asks for the plan on a GPU with that many SMs instead of `device`'s (the planner is a pure
    function of the shape and the SM count, so another card's plan can be drawn on this one).
    """
    from mingru.kernels import layout
    if sms is None:
        plan = layout.diagonal(B, T, D, device, "forward", "scan")
    else:
        plan = layout._diagonal(int(B), int(T), int(D), int(sms), layout.DIAGONAL_TILES["forward", "scan"],
                                (0, 0, 0))
    return Layout(plan.tile, plan.segments)


def allow_tf32_dots(allow=True):
    """Context manager: float32 tl.dot may use TF32 (allow=True) or keeps the IEEE guard."""
    from mingru.kernels.common import allow_tf32_dots as switch
    return switch(allow)


def dot_precision():
    """The input_precision the matrix kernels pass to a float32 tl.dot now: "ieee" unless lifted."""
    from mingru.kernels.common import dot_precision as current
    return current()


def matrix_uses_dot(k, v):
    """Whether a float32 matrix kernel at block size k and injection width v multiplies through tl.dot,
    which needs every dimension >= 16: the transition product at k >= 16, the injection's when v >= 16 too."""
    return k >= 16


def kernel_source(module, name):
    """The Python source of a function (a @triton.jit one included) of `mingru.kernels.<module>`."""
    import importlib
    import inspect
    fn = getattr(importlib.import_module(f"mingru.kernels.{module}"), name)
    return inspect.getsource(getattr(fn, "fn", fn))
