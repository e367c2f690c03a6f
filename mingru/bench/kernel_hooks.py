"""Every use the harnesses make of the kernels' internals, in one place: the test override hook
that forces a layout, the planner's choice, the switch that lifts the IEEE guard of tl.dot, and
the one that keeps the fused delta rule's dots all IEEE.

The kernel modules are imported only when a function here is called (`import mingru` never
imports Triton).
"""
import contextlib
from typing import NamedTuple


class Layout(NamedTuple):
    chunk: int     # time steps a program loads and combines together (the planner's tile)
    segments: int  # programs along time
    single_pass: bool = False  # the forward's look-back pass: one tile per segment, inputs read once




def forced_layout(chunk=0, segments=0):
    """Context manager: the diagonal kernels use tile length `chunk` (1: the sequential walk) and
    `segments` time segments (0 leaves either to the planner)."""
    from mingru.kernels import layout
    return layout.forced_layout(tile=chunk, segments=segments)


def diagonal_plan(B, T, D, device=None, sms=None):
    """The diagonal planner's forward layout for a (B, T, D) problem, as (chunk, segments, single_pass).

    `sms` asks for the plan on a GPU with that many SMs instead of `device`'s (the planner is a pure
    function of the shape and the SM count, so another card's plan can be drawn on this one).
    """
    from mingru.kernels import layout
    if sms is None:
        plan = layout.diagonal(B, T, D, device, "forward", "scan")
    else:
        plan = layout._diagonal(int(B), int(T), int(D), int(sms), layout.DIAGONAL_TILES["forward", "scan"],
                                layout.AUTO, layout.LOOKBACK_TILES["forward", "scan"])
    return Layout(plan.tile, plan.segments, plan.lookback)


def allow_tf32_dots(allow=True):
    """Context manager: float32 tl.dot may use TF32 (allow=True) or keeps the IEEE guard."""
    from mingru.kernels.common import allow_tf32_dots as switch
    return switch(allow)


@contextlib.contextmanager
def split_delta_dots(split=True):
    """Context manager: the fused delta rule's chunk-local kernels multiply in tf32x3 where their
    planner allows it (split=True, as shipped) or in IEEE like the rest (split=False)."""
    from mingru.kernels import delta_rule
    old, delta_rule.SPLIT_LOCAL = delta_rule.SPLIT_LOCAL, split
    try:
        yield
    finally:
        delta_rule.SPLIT_LOCAL = old


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


def forced_plan(tile=0, segments=0, block=0):
    """Context manager: every plan made inside uses this tile length, number of time segments and
    lanes per program (0 leaves each to the planner; rotation plans take only `block`)."""
    from mingru.kernels import layout
    return layout.forced_layout(tile=tile, segments=segments, block=block)


def matrix_plan(B, T, n, k, v, sms, direction="forward", prefix=True):
    """The matrix planner's layout for a (B, T, n, k, k) walk on a GPU with `sms` SMs, with the width the
    launcher gives it: v + k forward (the split's first pass carries the product), v + k in the
    backward plus k more when the prefix products have an adjoint (`prefix`: the scans, not
    matrix_recurrence)."""
    from mingru.kernels import layout
    width = v + k + (k if direction == "backward" and prefix else 0)
    return layout._matrix(int(B * n), int(T), int(k), int(width), int(sms), direction, layout.AUTO)


def rotation_plan(T, layers, k, itemsize, backward=False):
    """The rotation planner's layout for blocks of size k with `layers` Givens layers."""
    from mingru.kernels import layout
    return layout.rotation(T, layers, k // 2, itemsize, backward)


def planner_rules():
    """{name: docstring} of the planner module and of its three family rules and the shared time split,
    {name: value} of its module-level numeric constants, and one row per diagonal form's Tiles (its
    prefetch switch as yes / no)."""
    import inspect

    from mingru.kernels import layout
    docs = {"layout": layout, "split_time": layout.split_time, "diagonal": layout.diagonal,
            "matrix": layout.matrix, "rotation": layout.rotation}
    constants = {name: value for name, value in vars(layout).items()
                 if name.isupper() and isinstance(value, (int, float)) and not isinstance(value, bool)}
    tiles = [{"direction": direction, "form": form, **tiles._asdict(), "prefetch": "yes" if tiles.prefetch else "no"}
             for (direction, form), tiles in layout.DIAGONAL_TILES.items()]
    return {name: inspect.getdoc(obj) for name, obj in docs.items()}, constants, tiles
