"""What every kernel module shares on the Python side: the envelope check, the TF32 switch, the
launch (with its direct path for eager calls), op registration with its autograd glue, and
integer helpers."""
import contextlib
import functools
import inspect
from typing import NamedTuple

import torch
from torch.library import triton_op, wrap_triton

try:  # the switch triton_op's own eager implementation uses; private, so tolerate its absence
    from torch._library.triton import is_wrap_triton_enabled
    from torch._library.triton import wrap_triton_enabled as _wrap_state
except ImportError:  # pragma: no cover - older torch: launches go through the (slower) wrapper
    is_wrap_triton_enabled = lambda: True  # noqa: E731
    _wrap_state = None

from mingru.dispatch import ScanFallback, interpreting
from mingru.validate import FLOATS

_dot_precision = "ieee"


def dot_precision():
    """`input_precision` for every tl.dot that feeds a state: 'ieee' unless a caller opts out (the
    fused delta rule's chunk-local kernels read 'ieee' as 'tf32x3' where that keeps float32
    accuracy: `delta_rule._precisions`)."""
    return _dot_precision


@contextlib.contextmanager
def allow_tf32_dots(enabled=True):
    """Let tl.dot use TF32 tensor cores inside this block (for the precision notebook only)."""
    global _dot_precision
    old, _dot_precision = _dot_precision, ("tf32" if enabled else "ieee")
    try:
        yield
    finally:
        _dot_precision = old


def check_envelope(x, span=0, batch=0, sizes=()):
    """The envelope check of every kernel entry point: ScanFallback naming the first reason the
    kernel cannot take the call. x: an input (dtype, device); span: the largest element offset a
    program forms in 32-bit time arithmetic; batch: the launch grid's batch dimension; sizes:
    (name, size, allowed) triples. Messages are built only when raised: this runs on every call."""
    if x.dtype not in FLOATS:
        raise ScanFallback(f"dtype {x.dtype} is outside the kernel envelope")
    if not (x.is_cuda or (x.device.type == "cpu" and interpreting())):
        raise ScanFallback(f"tensors on {x.device.type} need CUDA (or TRITON_INTERPRET=1 on the CPU)")
    if span >= 2**31:
        raise ScanFallback("one batch element spans more than 2**31 elements (32-bit time offsets)")
    if batch >= 65536:
        raise ScanFallback(f"batch {batch} exceeds the launch grid (65535)")
    for name, size, allowed in sizes:
        if size not in allowed:
            raise ScanFallback(f"{name} = {size}: the kernels are compiled for {name} in {tuple(allowed)}")


def launch(kernel, grid, args, **more):
    """kernel[grid](**args, **more): `args` holds the arguments fixed by a plan (sizes, strides,
    constexprs, launch options; hashable values only), `more` the tensors and anything else.

    While wrap_triton is on (a tracer records the launch) the launch goes through it. Eager calls
    (wrap_triton off, as `scan_op` runs them) take the direct path of `_direct_launch`."""
    if is_wrap_triton_enabled():
        return wrap_triton(kernel)[grid](**more, **args)
    if _runtime is not None and isinstance(kernel, _runtime[2]):  # not the interpreter's kernels
        return _direct_launch(kernel, grid, args, more)
    return kernel.run(grid=grid, warmup=False, **more, **args)


try:  # what the direct path reads of Triton's runtime: present in the versions we support
    from triton import knobs as _knobs
    from triton.runtime import driver as _driver
    from triton.runtime.jit import JITFunction as _JITFunction
    _runtime = (_knobs.runtime, _driver, _JITFunction)
except ImportError:  # pragma: no cover - another Triton: every launch takes kernel.run
    _runtime = None


class _Compiled(NamedTuple):
    """One compiled kernel, ready to launch without Triton's binder."""
    compiled: object   # Triton's CompiledKernel (its launch_metadata feeds a profiler's launch hook)
    launcher: object   # compiled.run: the C launcher
    values: tuple      # every kernel argument in signature order; None where `fill` puts a call's value
    fill: tuple        # (position, name): the arguments taken from each call's `more`


# id(args) -> (args, {(kernel, grid, device, the specialization of `more`): _Compiled}). The args
# dict is held, so its id is not reused while the entry lives; plans are memoized, so one args dict
# serves every call of a signature (a fresh dict per call only ever takes kernel.run).
_compiled = {}
_COMPILED_MAX = 4096


def _direct_launch(kernel, grid, args, more):
    """Launch through the compiled kernel's launcher, as kernel.run does once it has found the kernel.

    kernel.run spends most of an eager call's host time binding and specializing each argument to
    find the compiled kernel. Here the compiled kernel is remembered per key of what Triton
    specializes on: the kernel, grid, current device, the plan's arguments (the args dict itself:
    a plan's dict is never modified), the names in `more` and per argument of `more` its dtype and
    16-byte alignment for a tensor, its value otherwise. The first
    call of a key goes through kernel.run (which compiles, launches and returns the kernel). The
    direct path skips what kernel.run checks again per launch with the same result: its pre-run
    hooks (none are registered on these kernels) and that the kernel's global values have not
    changed since compilation (module constants)."""
    runtime, driver, _ = _runtime
    device = driver.active.get_current_device()
    entry = _compiled.get(id(args))
    if entry is None or entry[0] is not args:
        if any(isinstance(x, torch.Tensor) for x in args.values()):  # not a plan: holding it would hold its tensors
            return kernel.run(grid=grid, warmup=False, **more, **args)
        if len(_compiled) >= _COMPILED_MAX:
            _compiled.clear()
        entry = _compiled[id(args)] = (args, {})
    key = (kernel, grid, device, tuple(more),
           *[(x.dtype, x.data_ptr() % 16 == 0) if isinstance(x, torch.Tensor) else x for x in more.values()])
    hit = entry[1].get(key)
    if hit is None:
        compiled = kernel.run(grid=grid, warmup=False, **more, **args)
        _remember(entry[1], key, kernel, compiled, args, more)
        return compiled
    values = list(hit.values)
    for i, name in hit.fill:
        values[i] = more[name]
    stream = driver.active.get_current_stream(device)
    enter, leave = _hook(runtime.launch_enter_hook), _hook(runtime.launch_exit_hook)
    meta = None if enter is None else hit.compiled.launch_metadata(grid, stream, *values)
    hit.launcher(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                 hit.compiled.function, hit.compiled.packed_metadata, meta, enter, leave, *values)
    return hit.compiled


def _hook(chain):
    """A launch hook as the launcher takes it: None for an empty chain (Triton's hooks are chains of
    callables, empty unless a profiler registers one), so no launch metadata is built and the
    launcher calls nothing; anything else as it is."""
    return None if chain is None or getattr(chain, "calls", True) == [] else chain


def _remember(known, key, kernel, compiled, args, more):
    """Store in `known` the _Compiled of `key` when kernel.run returned a compiled kernel whose
    launcher and arguments are known (an asynchronous compile returns a future: it is not stored)."""
    if getattr(kernel, "pre_run_hooks", None) or not all(hasattr(compiled, a) for a in ("run", "function",
                                                                                        "packed_metadata")):
        return
    values, fill = [], []
    for i, param in enumerate(kernel.params):
        name = param.name
        if name in more:
            values.append(None)
            fill.append((i, name))
        elif name in args:
            values.append(args[name])
        else:
            default = kernel.signature.parameters[name].default
            if default is inspect.Parameter.empty:
                return
            values.append(default)
    known[key] = _Compiled(compiled, compiled.run, tuple(values), tuple(fill))


def planned(plan):
    """`plan` memoized on its arguments: a launch plan is a pure function of sizes, strides, dtype,
    device and the global switches (pass every one it reads), so each call signature is planned
    once. Symbolic sizes (torch.compile with dynamic shapes) do not hash: those are planned on
    every call."""
    memo = functools.lru_cache(maxsize=4096)(plan)

    @functools.wraps(plan)
    def get(*key):
        try:
            return memo(*key)
        except TypeError:
            return plan(*key)
    return get


# Plain Python on purpose: triton.cdiv and triton.next_power_of_2 are JIT-aware functions, slow
# enough per call to show in the host time of a launch.
def cdiv(a, b):
    return -(-a // b)


def next_pow2(n):
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def cotangent(g, like):
    """The cotangent of output `like` as the backward launchers take it: autograd passes None for
    an unused output, which is zeros. (The launchers make every cotangent contiguous themselves.)"""
    return torch.zeros_like(like) if g is None else g


def _autograd(saved, optional, aux=0, unread=()):
    """setup_context and grad for register_autograd: the backward launcher takes the inputs at
    indices `saved`, then every output, then one cotangent per output, and returns one gradient per
    input that is not a size. The inputs at indices `optional` may be None (an initial state, a
    scale) and get a gradient only when passed; a size (an int input) is saved as it is and gets
    none. The last `aux` outputs only carry the forward's work to the backward: their cotangents
    are ignored and passed as empty tensors. The outputs at indices `unread` are not saved (the
    backward never reads them, so their memory can go as soon as nothing else holds it): the
    launcher gets a stand-in of their shape and dtype that owns no memory."""
    def setup_context(ctx, inputs, output):
        output = output if isinstance(output, tuple) else (output,)
        ctx.sizes = [i for i, x in enumerate(inputs) if isinstance(x, int)]
        ctx.absent = [i for i in optional if inputs[i] is None]
        kept = [inputs[i] for i in saved]
        ctx.kept_sizes = {j: x for j, x in enumerate(kept) if isinstance(x, int)}
        ctx.unread = {j: (output[j].shape, output[j].dtype, output[j].device) for j in unread}
        ctx.save_for_backward(*(None if j in ctx.kept_sizes else x for j, x in enumerate(kept)),
                              *(None if j in ctx.unread else o for j, o in enumerate(output)))

    def grad(ctx, backward, *g):
        tensors = list(ctx.saved_tensors)
        for j, x in ctx.kept_sizes.items():
            tensors[j] = x
        first = len(tensors) - len(g)
        for j, (shape, dtype, device) in ctx.unread.items():
            tensors[first + j] = torch.empty_strided(shape, [0] * len(shape), dtype=dtype, device=device)
        outputs = tensors[first:]
        cots = [cotangent(gi, o) for gi, o in zip(g[:len(g) - aux], outputs)]
        cots += [o.new_empty(0) for o in outputs[len(g) - aux:]]
        grads = backward(*tensors, *cots)
        grads = [grads] if isinstance(grads, torch.Tensor) else list(grads)  # an op of one input
        for i in ctx.sizes:
            grads.insert(i, None)
        return tuple(None if i in ctx.absent else gi for i, gi in enumerate(grads))
    return setup_context, grad


def scan_op(name, forward, backward, saved, optional=(), aux=0, unread=()):
    """Register a kernel pair as the custom ops mingru::<name> and mingru::<name>_backward, and
    return the callable the entry points use.

    forward(*inputs) and backward(*inputs[saved], *outputs, *cotangents) are plain launchers with
    type hints; the inputs at indices `optional` may be None, the last `aux` outputs carry no
    gradient, and the outputs at indices `unread` are not kept for the backward (see `_autograd`).
    Under torch.compile the callable is the registered triton_op, which the compiler traces without
    a graph break. In eager it is an autograd.Function over the same launchers: the custom-op
    dispatcher and wrap_triton's launch path (which the launchers use so that tracers see the
    kernels) both cost host time per call that can exceed the kernel's own at small shapes.
    Inference calls (no input requires grad, or grad mode off) skip the autograd.Function as well.
    """
    setup_context, grad = _autograd(saved, optional, aux, unread)
    ops = torch.ops.mingru
    triton_op(f"mingru::{name}", mutates_args=())(forward)
    triton_op(f"mingru::{name}_backward", mutates_args=())(backward)
    registered, registered_backward = getattr(ops, name), getattr(ops, f"{name}_backward")
    torch.library.register_autograd(f"mingru::{name}", lambda ctx, *g: grad(ctx, registered_backward, *g),
                                    setup_context=setup_context)
    def direct_forward(ctx, *inputs):  # the ctx-first form: apply() then skips binding by signature
        output = _unwrapped(forward, *inputs)
        setup_context(ctx, inputs, output)
        # an output without a gradient reaches `grad` as None: autograd would fill it with zeros, which
        # `cotangent` makes only where a launcher reads them (never for the `aux` outputs)
        ctx.set_materialize_grads(False)
        if aux:
            ctx.mark_non_differentiable(*output[len(output) - aux:])
        return output

    def direct_backward(ctx, *g):
        return _unwrapped(grad, ctx, backward, *g)

    direct = type(name, (torch.autograd.Function,), {
        "forward": staticmethod(direct_forward), "backward": staticmethod(direct_backward)})

    def call(*inputs):
        # Any tracer (dynamo, make_fx, export, fake tensors) sees the registered op; plain eager
        # launches the kernels directly, without wrap_triton's per-launch tracing machinery.
        if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
            return registered(*inputs)
        if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
            return direct.apply(*inputs)
        return _unwrapped(forward, *inputs)  # inference: no graph to record, so no autograd.Function
    return call


def _unwrapped(fn, *args):
    """fn(*args) with wrap_triton off, as torch's `set_wrap_triton_enabled(False)` would run it,
    without the cost of entering a context manager on every call."""
    if _wrap_state is None:  # pragma: no cover - older torch
        return fn(*args)
    prev = is_wrap_triton_enabled()
    _wrap_state.value = False
    try:
        return fn(*args)
    finally:
        _wrap_state.value = prev
