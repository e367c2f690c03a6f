"""Where the host's time goes in one small Triton call (GPU): cProfile of repeated calls, top entries."""
import cProfile
import os
import pstats

import torch

import mingru
from mingru.bench import cases

os.environ["MINGRU_SCAN"] = "triton"
for op, dims in [("linear_recurrence", dict(B=128, T=64, D=64)), ("matrix_affine_scan", dict(B=128, T=64, n=8, k=8, v=1))]:
    job = cases.make(op, dims, device="cuda").requiring_grad()
    outs = cases.outputs(job.fn, job.inputs)
    cot = cases.cotangents_for(outs)
    for _ in range(20):
        cases.step(job, cot)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        cases.step(job, cot)
    torch.cuda.synchronize()
    prof.disable()
    print(f"== {op} {dims}: 200 fwd+bwd calls")
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
