"""Memory: peak allocated bytes of a mixer's forward + backward, fused vs generic, Triton vs eager."""
import torch

from mingru.bench import cases, warm
from mingru.bench.parity import SKIPPED
from mingru.bench.progress import Sweep
from mingru.bench.timing import failure, peak_mb, scan_impl

NAME, SUBJECT = "scan_memory", "mixer"
LAB, QUICK_LAB = dict(B=128, T=64, d=64), dict(B=2, T=8, d=8, k=4, L=2)
LAB_MIXERS = ("GivensMinGRU[fused]", "GivensMinGRU[generic]", "RotationMinGRU")
VS_T, QUICK_VS_T = (64, 256, 1024, 4096), (4, 8)  # a factor of 4 apart: the growth exponent needs two
VS_T_B, QUICK_VS_T_B = 16, 1
QUICK_LAB_MIXERS, QUICK_VS_T_MIXERS = LAB_MIXERS[2:], LAB_MIXERS[2:3]  # the interpreter is slow
METHOD = ("CUDA: after a warm-up step, gc + torch.cuda.empty_cache() + reset_peak_memory_stats(); "
          "then build the module and input, run forward and backward of a random cotangent; peak_mb = "
          "max_memory_allocated() - memory_allocated() before the build, so parameters, inputs, "
          "activations and gradients are all counted. saved_mb (any device) = distinct storages "
          "autograd saved for backward, seen through saved_tensors_hooks. float32, k=8, rounds=3.")


def _saved_storages(store):
    def pack(t):
        storage = t.untyped_storage()
        store[storage.data_ptr()] = storage.nbytes()
        return t
    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _step(name, dims, device, saved):
    job = cases.make(name, dims, torch.float32, device).requiring_grad()
    with _saved_storages(saved):
        outs = cases.outputs(job.fn, job.inputs)
    torch.autograd.backward(outs, cases.cotangents_for(outs))


def peak(name, dims, impl, device):
    """{'peak_mb', 'saved_mb'} of one forward + backward of a fresh module and input."""
    saved = {}

    def step():
        saved.clear()  # count the storages of the last step only
        _step(name, dims, device, saved)
    with scan_impl(impl):
        mb = peak_mb(step, device)
        if mb is None:
            step()
    return {"peak_mb": mb, "saved_mb": sum(saved.values()) / 2**20}


def _todo(device, quick, env, keep):
    """(case, mixer, dims, impl) of every row."""
    lab = QUICK_LAB if quick else LAB
    Ts, B, mixers = (QUICK_VS_T, QUICK_VS_T_B, QUICK_VS_T_MIXERS) if quick else (VS_T, VS_T_B, cases.MIXERS)
    impls = ("eager", "triton") if cases.kernels_run(device, env) else ("eager",)
    todo = [("lab", name, lab) for name in (QUICK_LAB_MIXERS if quick else LAB_MIXERS)]
    todo += [("vs-T", name, {**lab, "B": B, "T": T}) for name in mixers for T in Ts]
    return [(case, name, dims, impl) for case, name, dims in todo if keep(name) for impl in impls]


def compile_case(name, dims, device):
    """One forward + backward through the kernels, nothing measured: what the compile pool runs."""
    with scan_impl("triton"):
        _step(name, dims, device, {})


def compile_plan(device, quick, env, keep=lambda name: True):
    """[(target, cases)] that the compile pool runs once before the sweep: every Triton row."""
    return [("mingru.bench.memory:compile_case",
             [(name, dims, device) for _, name, dims, impl in _todo(device, quick, env, keep) if impl == "triton"])]


def measure(device, quick, env, keep=lambda name: True):
    todo = _todo(device, quick, env, keep)
    warm.warm_plans(compile_plan(device, quick, env, keep), warm.default_workers(device))
    rows = []
    for case, name, dims, impl in Sweep("memory", todo, lambda c: f"{c[1]} {cases.label(c[2])} {c[3]}"):
        row = {"case": case, "mixer": name, "impl": impl, **dims}
        try:
            rows.append({**row, **peak(name, dims, impl, device), "status": "ok"})
        except Exception as exc:  # noqa: BLE001  (an out-of-memory or declined kernel becomes a row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            rows.append({**row, "peak_mb": None, "saved_mb": None, "status": failure(exc)})
    if not cases.kernels_run(device, env):
        rows.append({"case": "all", "impl": "triton", "status": SKIPPED})
    return rows


def summarize(rows, env):
    return {"method": METHOD,
            "columns": ["case", "mixer", "impl", "B", "T", "d", "peak_mb", "saved_mb", "status"],
            "notes": [METHOD] + _ratios(rows)}


def _ratios(rows):
    """'GivensMinGRU triton: generic / fused peak = 10.3x' for the lab shape."""
    lab = {(r["mixer"], r["impl"]): r.get("peak_mb") or r.get("saved_mb") for r in rows if r.get("case") == "lab"}
    notes = []
    for (mixer, impl), fused in lab.items():
        if mixer.endswith("[fused]"):
            generic = lab.get((mixer.replace("fused", "generic"), impl))
            if fused and generic:
                notes.append(f"{mixer[:-7]} {impl}: generic / fused memory = {generic / fused:.1f}x")
    return notes
