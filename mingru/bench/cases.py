"""What every harness runs: fresh random, non-zero inputs for an op or a mixer, a call, a backward.

A subject is an op name ("linear_scan") or a mixer name with its path ("GivensMinGRU[fused]").
Its dims: B, T and D for the diagonal ops; B, T, n blocks of k (x v) for the matrix ops; n, k and
L Givens layers for rotation_recurrence; B, T, d (and GivensMinGRU's k, L) for the mixers;
h0=True adds a start state (gated_recurrence always takes one).
"""
import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import mingru
from mingru import naive

DIAGONAL = ("linear_scan", "linear_recurrence", "parallel_scan_log", "gated_recurrence")
OPS = DIAGONAL + ("matrix_scan", "matrix_affine_scan", "matrix_recurrence", "rotation_recurrence")
MIXERS = ("MinGRU", "SignedMinGRU", "RotationMinGRU", "GivensMinGRU[fused]", "GivensMinGRU[generic]")


@dataclass
class Job:
    """fn(*inputs), plus module parameters, which receive gradients too."""
    name: str
    fn: object
    inputs: tuple
    params: tuple = ()

    def requiring_grad(self):
        inputs = tuple(None if x is None else x.detach().requires_grad_() for x in self.inputs)
        return Job(self.name, self.fn, inputs, self.params)

    @property
    def leaves(self):
        return tuple(x for x in self.inputs if x is not None and x.requires_grad) + self.params

    def in_float64(self):
        """The same job in float64 (a mixer: a float64 copy of the module), its inputs requiring
        grad where this job's do; leaves pair up with this job's in order."""
        fn = copy.deepcopy(self.fn).double() if isinstance(self.fn, torch.nn.Module) else self.fn
        inputs = tuple(None if x is None else x.detach().double().requires_grad_(x.requires_grad)
                       for x in self.inputs)
        return Job(self.name, fn, inputs, tuple(fn.parameters()) if self.params else ())


def kernels_run(device, env):
    """Triton kernels run on CUDA, or on the CPU through the interpreter (TRITON_INTERPRET=1)."""
    return device.type == "cuda" or env["triton_interpret"]


def label(dims):
    """'B128-T64-D64', with '-h0' when a start state is passed and '-scale' when a scale is."""
    text = "-".join(f"{k}{v}" for k, v in dims.items() if k not in ("h0", "scale"))
    return text + ("-h0" if dims.get("h0") else "") + ("-scale" if dims.get("scale") else "")


def make(name, dims, dtype=torch.float32, device="cpu"):
    if name in OPS:
        return Job(name, getattr(mingru, name), op_inputs(name, dims, dtype, device))
    module = mixer(name, dims).to(device, dtype)
    x = torch.randn(dims["B"], dims["T"], dims["d"], device=device, dtype=dtype)
    return Job(name, module, (x,), tuple(module.parameters()))


def mixer(name, dims):
    """Our mixer `name` ('GivensMinGRU[fused]', 'MinGRU', ...) at width dims['d'].

    The one place that calls the mixers' constructors: MinGRU and SignedMinGRU take
    (input_size, hidden_size); Givens' path, block size (k) and rounds (L Givens layers) are keywords;
    a path in brackets sets the `fused` keyword: '[fused]' True, any other ('[generic]', '[chunked]') False.
    """
    base, _, path = name.partition("[")
    kwargs = {"fused": path.startswith("fused")} if path else {}
    if base == "GivensMinGRU":
        kwargs.update(block_size=dims.get("k", 8), rounds=dims.get("L", 3))
    return getattr(mingru, base)(dims["d"], dims["d"], **kwargs)


def _signed(*shape, device):
    # |a| in [0.5, 1) with a random sign: long memory, no overflow, never zero.
    return (0.5 + 0.5 * torch.rand(shape, device=device)) * torch.randn(shape, device=device).sign()


def _contractive(*shape, device):
    # Gaussian k x k blocks scaled so that long products decay (negative top Lyapunov exponent).
    return torch.randn(shape, device=device) * (0.6 / math.sqrt(shape[-1]))


def op_inputs(op, dims, dtype=torch.float32, device="cpu"):
    B, T, h0 = dims["B"], dims["T"], dims.get("h0", False)
    randn = lambda *shape: torch.randn(shape, device=device)  # noqa: E731
    if op == "parallel_scan_log":
        D = dims["D"]
        xs = (-F.softplus(randn(B, T, D)), randn(B, T + 1, D))
    elif op == "gated_recurrence":  # MinGRU's pre-activations; its state is never negative
        D = dims["D"]
        xs = (randn(B, T, D), randn(B, T, D), torch.rand(B, D, device=device))
    elif op == "gated_recurrence_stacked":  # k | cand as one projection writes them, and its bias
        D = dims["D"]
        xs = (randn(B, T, 2 * D), torch.rand(B, D, device=device), randn(2 * D))
    elif op == "signed_recurrence_stacked":  # k | cand | s as SignedMinGRU's one projection writes them
        D = dims["D"]
        xs = (randn(B, T, 3 * D), randn(B, D), randn(3 * D))
    elif op in DIAGONAL:
        D = dims["D"]
        xs = (_signed(B, T, D, device=device), randn(B, T, D))
        if op == "linear_recurrence":
            xs += (randn(B, D) if h0 else None,)
    elif op == "matrix_scan":
        n = dims["n"]
        xs = (_contractive(B, T, n, 2, 2, device=device), randn(B, T, n, 2))
    elif op == "rotation_recurrence":
        n, k, L = dims["n"], dims["k"], dims["L"]
        angles = math.pi * (2 * torch.rand(B, T, n, L, k // 2, device=device) - 1)
        decay = 0.5 + 0.5 * torch.rand(B, T, n, device=device)
        xs = (angles, decay, randn(B, T, n, k), randn(B, n, k) if h0 else None)
        if dims.get("scale"):  # RotationMinGRU's tanh(linear_u x)
            xs += (2 * torch.rand(B, T, n, device=device) - 1,)
    else:
        n, k, v = dims["n"], dims["k"], dims["v"]
        xs = (_contractive(B, T, n, k, k, device=device), randn(B, T, n, k, v))
        if op == "matrix_recurrence":
            xs += (randn(B, n, k, v) if h0 else None,)
    return tuple(None if x is None else x.to(dtype) for x in xs)


def naive_fn(name):
    """The float64 sequential reference of an op (None for mixers)."""
    return getattr(naive, f"{name}_naive", None)


def outputs(fn, inputs):
    out = fn(*inputs)
    return out if isinstance(out, tuple) else (out,)


def forward(job, fn=None):
    """Inference: outputs only, no autograd graph."""
    with torch.no_grad():
        return outputs(job.fn if fn is None else fn, job.inputs), ()


def forward_backward(job, cotangents, fn=None):
    """Outputs and the gradients of sum(out * cotangent) for every leaf; job must require grad."""
    outs = outputs(job.fn if fn is None else fn, job.inputs)
    grads = torch.autograd.grad(outs, job.leaves, cotangents, allow_unused=True)
    return tuple(o.detach() for o in outs), grads


def cotangents_for(outs):
    return tuple(torch.randn_like(o) for o in outs)


def step(job, cotangents, fn=None):
    """The timed unit: inference (cotangents None) or forward + backward into .grad."""
    fn = job.fn if fn is None else fn  # (a module has no truth value)
    if cotangents is None:
        with torch.no_grad():
            fn(*job.inputs)
    else:
        torch.autograd.backward(outputs(fn, job.inputs), cotangents)


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def least_bytes(in_bytes, out_bytes, direction):
    """The bytes any implementation must move: the forward reads every input once and writes every
    output once; the backward reads the cotangents and the inputs once and writes one gradient per
    input. So fwd = in + out and fwd+bwd = 3 in + 2 out."""
    return in_bytes + out_bytes if direction == "fwd" else 3 * in_bytes + 2 * out_bytes
