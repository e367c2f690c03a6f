"""Every use the harnesses make of the kernels' internals, in one place: the test override hook
that forces a layout, the planner's choice, and the switch that lifts the IEEE guard of tl.dot.

The kernel modules are imported only when a function here is called (`import mingru` never
imports Triton).
"""


def forced_layout(**force):
    """Context manager: the diagonal kernels use the given tile length `chunk` and `segments`."""
    from mingru.kernels import diagonal
    return diagonal.forced_layout(**force)


def diagonal_plan(B, T, D, device):
    """The diagonal planner's layout for a (B, T, D) problem: has .chunk and .segments."""
    from mingru.kernels import diagonal
    return diagonal.plan(B, T, D, device)


def allow_tf32_dots(allow=True):
    """Context manager: float32 tl.dot may use TF32 (allow=True) or keeps the IEEE guard."""
    from mingru.kernels.common import allow_tf32_dots as switch
    return switch(allow)
