"""The dispatch seam: which implementation of a scan runs, decided at call time.

MINGRU_SCAN=eager  always the pure-torch reference.
MINGRU_SCAN=auto   (default) Triton on CUDA tensors inside the kernel envelope; otherwise
                   eager, with one warning per process when a CUDA call had to fall back.
MINGRU_SCAN=triton the Triton kernel or a RuntimeError naming the reason, never a silent
                   downgrade. CPU tensors reach the kernels only with TRITON_INTERPRET=1.

Triton is imported only when a kernel is first needed, so `import mingru` stays light.
"""
import contextlib
import importlib
import os
import sys
import warnings

import torch

MODES = ("auto", "eager", "triton")

# op name -> "module:function" of its Triton implementation.
TRITON_IMPLS = {
    "linear_scan": "mingru.kernels.diagonal:linear_scan",
    "linear_recurrence": "mingru.kernels.diagonal:linear_recurrence",
    "parallel_scan_log": "mingru.kernels.diagonal:parallel_scan_log",
    "gated_recurrence": "mingru.kernels.diagonal:gated_recurrence",
    "gated_recurrence_stacked": "mingru.kernels.diagonal:gated_recurrence_stacked",
    "signed_recurrence_stacked": "mingru.kernels.diagonal:signed_recurrence_stacked",
    "matrix_scan": "mingru.kernels.matrix:matrix_scan",
    "matrix_affine_scan": "mingru.kernels.matrix:matrix_affine_scan",
    "matrix_recurrence": "mingru.kernels.matrix:matrix_recurrence",
    "rotation_recurrence": "mingru.kernels.rotation:rotation_recurrence",
    "unit_lower_solve": "mingru.kernels.triangular:unit_lower_solve",
    "unit_lower_inverse": "mingru.kernels.triangular:unit_lower_inverse",
    "delta_rule": "mingru.kernels.delta_rule:delta_rule",
    "delta_layer": "mingru.kernels.delta_rule:delta_layer",
}


# Set by mingru.distributed.sequence_parallel: a callable (name, *args) that runs a states-only op
# on this rank's time slice. None (the default) leaves dispatch alone. A plain global, not a
# ContextVar: torch.compile traces a global read, a ContextVar.get breaks the graph.
sequence_parallel_route = None


class ScanFallback(Exception):
    """Raised by a Triton implementation to decline a call (input outside its envelope)."""


_warned = False


def scan_mode():
    mode = os.environ.get("MINGRU_SCAN", "auto")
    if mode in MODES:  # the usual spelling: nothing to normalize
        return mode
    mode = mode.strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"MINGRU_SCAN={mode!r}: expected one of {', '.join(MODES)}")
    return mode


@contextlib.contextmanager
def using(mode):
    """Run the enclosed calls with MINGRU_SCAN=mode (one of MODES), restoring the old value after."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: expected one of {', '.join(MODES)}")
    old = os.environ.get("MINGRU_SCAN")
    os.environ["MINGRU_SCAN"] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MINGRU_SCAN", None)
        else:
            os.environ["MINGRU_SCAN"] = old


def interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _import_traced(module):
    """Import the kernel modules with import statements and return `module`: torch.compile runs an
    import statement while it traces (importlib and sys.modules it cannot), so a first compile
    needs no warm-up."""
    from mingru import kernels
    from mingru.kernels import delta_rule, diagonal, matrix, rotation, triangular, wide  # noqa: F401
    return getattr(kernels, module.removeprefix("mingru.kernels."))


_resolved = {}  # "module:function" -> the function, once imported outside torch.compile


def triton_impl(name):
    """Import and return the Triton implementation of `name`, or raise ScanFallback."""
    spec = TRITON_IMPLS[name]
    compiling = torch.compiler.is_compiling()
    if not compiling and spec in _resolved:
        return _resolved[spec]
    module, func = spec.split(":")
    try:
        if compiling:  # no sys.modules lookup: dynamo would guard on its contents
            return getattr(_import_traced(module), func)
        loaded = sys.modules.get(module) or importlib.import_module(module)
    except ImportError as err:  # triton missing, or torch too old for triton_op
        raise ScanFallback(f"Triton backend unavailable ({err})") from err
    impl = _resolved[spec] = getattr(loaded, func)
    return impl


def _warn_once(name, reason):
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"mingru: {name} runs the eager scan ({reason}); this warning is shown "
                      "once per process", RuntimeWarning, stacklevel=4)


def _eager_by_mode(mode, x):
    return mode == "eager" or (mode == "auto" and x.device.type != "cuda")


def runs_eager(x):
    """Whether dispatch runs the eager scan for inputs on x's device: MINGRU_SCAN=eager, or auto off
    CUDA (a caller with an eager-only form of its own picks it from this)."""
    return _eager_by_mode(scan_mode(), x)


def dispatch(name, eager, *args, local=False, empty=False):
    """Run op `name` on `args` with the implementation MINGRU_SCAN selects. local=True: a step
    inside a larger computation (not a scan over the caller's time axis), never sequence-parallel.
    empty=True: some argument has a size-0 axis (the caller knows its sizes), so eager runs, as
    it does when args[0] is empty."""
    if sequence_parallel_route is not None and not local:
        return sequence_parallel_route(name, *args)
    mode = scan_mode()
    if empty or _eager_by_mode(mode, args[0]) or args[0].numel() == 0:
        return eager(*args)  # empty inputs need no kernel launch (none is built for a size of 0)
    try:
        if args[0].device.type != "cuda" and not interpreting():
            raise ScanFallback(f"tensors are on {args[0].device.type}; the kernels need CUDA "
                               "(or TRITON_INTERPRET=1 to run them on the CPU)")
        return triton_impl(name)(*args)
    except ScanFallback as reason:
        if mode == "triton":
            raise RuntimeError(f"MINGRU_SCAN=triton: {name} cannot run its kernel: {reason}") from reason
        _warn_once(name, reason)
        return eager(*args)
