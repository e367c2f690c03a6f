"""What the kernel and scan tests share: outputs and input gradients for given cotangents."""
import torch


def as_tuple(outs):
    """An op's result as a tuple of outputs (ops return one tensor or a tuple)."""
    return outs if isinstance(outs, tuple) else (outs,)


def outputs_and_grads(fn, inputs, cotangents):
    """fn(*inputs) as a list of outputs, and d(sum out * cotangent)/d input for every input.

    An input the outputs do not depend on (a at T=1 with h0 = 0) gets a zero gradient.
    """
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    outs = list(as_tuple(fn(*inputs)))
    torch.autograd.backward(outs, [c.to(o.dtype) for o, c in zip(outs, cotangents)])
    return outs, [torch.zeros_like(x) if x.grad is None else x.grad for x in inputs]
