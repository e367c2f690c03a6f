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
