"""Where the host's time goes on the GPU machine: environment, the wall cost of a tiny torch op, an
allocation, a bare Triton launch and one of our calls, and a cProfile of repeated small Triton
calls (linear_scan forward, matrix_affine_scan fwd+bwd). Run it on the device: python3 tools/profile_host.py"""
import cProfile
import os
import pstats
import time

import torch

import mingru
from mingru.bench import cases

import triton
import triton.language as tl


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


print({k: v for k, v in os.environ.items() if any(s in k for s in ("CUDA", "TORCH", "TRITON", "PYTHON"))})
x = torch.randn(128, 64, 64, device="cuda")
y = torch.empty_like(x)
os.environ["MINGRU_SCAN"] = "triton"
CALLS = [("torch.add", lambda: x + 1), ("torch.empty_like", lambda: torch.empty_like(x)),
         ("bare triton launch", lambda: _add_one[(x.numel() // 1024,)](y, y.numel(), BLOCK=1024)),
         ("linear_scan (triton)", lambda: mingru.linear_scan(x, x))]


def wall_us(fn, calls=500):
    """Wall time per call of `fn` run back to back, after a warm-up."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def per_call(when):
    for label, fn in CALLS:
        print(f"{when}: {label}: {wall_us(fn):.1f} us per call (wall, back to back)")


per_call("fresh process")
torch.compile(lambda t: t.cumsum(1) * 2)(x)  # the speed harness runs inductor before our calls
per_call("after one torch.compile")
for op, dims, cot in [("linear_scan", dict(B=128, T=64, D=64), False),
                      ("matrix_affine_scan", dict(B=128, T=64, n=8, k=8, v=1), True)]:
    job = cases.make(op, dims, device="cuda").requiring_grad()
    cots = cases.cotangents_for(cases.outputs(job.fn, job.inputs)) if cot else None
    for _ in range(20):
        cases.step(job, cots)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        cases.step(job, cots)
    torch.cuda.synchronize()
    prof.disable()
    print(f"== {op} {dims}: 200 {'fwd+bwd' if cot else 'fwd'} calls")
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)

# fwd+bwd on the host: ours against accelerated-scan's Triton scan (one autograd.Function, one
# kernel each way), with torch.profiler recording every thread (autograd runs the backward of CUDA
# tensors on its own device thread, which cProfile does not see).
from torch.profiler import ProfilerActivity, profile  # noqa: E402

try:
    from accelerated_scan.scalar import scan as acc_scan
except ImportError:
    acc_scan = None
g = torch.rand(128, 64, 64, device="cuda") * 0.9 + 0.05
u = torch.randn(128, 64, 64, device="cuda")
pairs = [("mingru.linear_recurrence", lambda a, b: mingru.linear_recurrence(a, b), g, u)]
if acc_scan is not None:
    pairs.append(("accelerated_scan", acc_scan, g.transpose(1, 2).contiguous(), u.transpose(1, 2).contiguous()))
for label, fn, a0, b0 in pairs:
    a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
    cot = torch.randn_like(b0)

    def fwd_bwd():
        a.grad = b.grad = None
        fn(a, b).backward(cot)
    print(f"== {label}: fwd+bwd {wall_us(fwd_bwd, 300):.1f} us per call (wall, back to back)")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(50):
            fwd_bwd()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
