"""The cases of the differential test against mingru-scans 0.2.0, and the script that runs them.

`python tests/seedrun.py SEED_DIR OUT` imports the published package from SEED_DIR (it is also
called `mingru`, so it runs in its own process), builds every case with a fixed seed, and saves
the state_dict, inputs, outputs and gradients of each to OUT with torch.save. `run_case` is
shared with the test, which repeats each case on our package from the saved state_dict.
"""
import os
import sys

import torch

B, T, D_IN, H, CUT = 2, 7, 5, 8, 3  # batch, length, input width, hidden width, chain cut point

# name -> (class, constructor kwargs, delta_t kind: None | "BT" | "BT1" | "bad", dtype)
MIXER_CASES = {
    "log": ("MinGRU", {}, None, "float64"),
    "log-f32": ("MinGRU", {}, None, "float32"),
    "log-h0-nobias": ("MinGRU", {"learnable_h0": True, "bias": False}, None, "float64"),
    "log-fixed": ("MinGRU", {"decay": "fixed", "decay_rate": 0.7}, "BT", "float64"),
    "log-learnable-log1p": ("MinGRU", {"decay": "learnable", "log1p_delta": True}, "BT1", "float64"),
    "log-bad-dt": ("MinGRU", {"decay": "fixed"}, "bad", "float64"),
    "signed": ("SignedMinGRU", {}, None, "float64"),
    "signed-coupled-h0": ("SignedMinGRU", {"coupled": True, "learnable_h0": True}, None, "float64"),
    "signed-fixed": ("SignedMinGRU", {"decay": "fixed", "decay_rate": 2.0}, "BT", "float64"),
    "signed-learnable": ("SignedMinGRU", {"decay": "learnable"}, "BT", "float64"),
    "rotation": ("RotationMinGRU", {}, None, "float64"),
    "rotation-nosnap": ("RotationMinGRU", {"snap": None}, None, "float64"),
    "rotation-fixed": ("RotationMinGRU", {"decay": "fixed", "snap": (3, 5)}, "BT", "float64"),
    "rotation-learnable": ("RotationMinGRU", {"decay": "learnable"}, "bad", "float64"),
    "givens": ("GivensMinGRU", {}, None, "float64"),
    "givens-f32": ("GivensMinGRU", {}, None, "float32"),
    "givens-k4-r2": ("GivensMinGRU", {"block_size": 4, "rounds": 2}, None, "float64"),
    "givens-k2-r1-fixed": ("GivensMinGRU", {"block_size": 2, "rounds": 1, "decay": "fixed"}, "BT",
                           "float64"),
    "givens-learnable": ("GivensMinGRU", {"block_size": 4, "decay": "learnable"}, "BT1", "float64"),
}
# name -> (stack kwargs, delta_t kind); every stack is MinGRUStack(D_IN, H, 2, **kwargs)
STACK_CASES = {
    "stack-log": ({"learnable_h0": True}, None),
    "stack-signed-decay-last": ({"mixer": "signed", "mixer_kwargs": {"decay": "fixed"},
                                 "decay_layers": "last"}, "BT"),
    "stack-mixed": ({"mixer": ["rotation", "givens"], "mlp_expansion": 0,
                     "mixer_kwargs": {"givens": {"block_size": 4, "decay": "learnable"}}}, "BT"),
    "stack-delta": ({"mixer": "delta", "mixer_kwargs": {"n_heads": 2, "nh": 2, "chunk_size": 4,
                                                        "decay": "fixed"}}, "BT"),
}


def make_inputs(kind, dtype, gen):
    x = torch.randn(B, T, D_IN, generator=gen, dtype=dtype)
    w = torch.randn(B, T, H, generator=gen, dtype=dtype)  # loss = sum(w * output)
    dt = None
    if kind is not None:
        dt = torch.rand(B, T, generator=gen, dtype=dtype) * 2
        if kind == "bad":
            dt[0, 1], dt[1, 2], dt[0, 4], dt[1, 5] = float("nan"), float("inf"), -1.0, -float("inf")
        if kind == "BT1":
            dt = dt.unsqueeze(-1)
    return x, w, dt


def _sl(dt, a, b):
    return None if dt is None else dt[:, a:b]


def run_case(module, x, w, dt, stack):
    """Outputs and gradients of `module`: forward, chained forward, step loop (a dict of tensors)."""
    x = x.clone().requires_grad_(True)
    module.zero_grad()
    y = module(x, None, dt)
    out = y[0] if stack else y
    (w * out).sum().backward()
    res = {"y": out.detach(), "dx": x.grad}
    res.update({"d." + n: p.grad for n, p in module.named_parameters() if p.grad is not None})
    with torch.no_grad():
        x = x.detach()
        first = module(x[:, :CUT], None, _sl(dt, 0, CUT))
        carry = first[1] if stack else first[:, -1:]
        second = module(x[:, CUT:], carry, _sl(dt, CUT, T))
        res["chained"] = torch.cat([first[0], second[0]] if stack else [first, second], 1)
        state = module.init_state() if stack else None
        steps = []
        for t in range(T):
            dt_t = None if dt is None else dt[:, t]
            y_t = module.step(x[:, t], state, dt_t)
            y_t, state = (y_t if stack else (y_t, y_t))
            steps.append(y_t)
        res["steps"] = torch.stack(steps, 1)
    return res


def build(lib, name):
    """(module, inputs) of case `name` from the package `lib`, seeded so both sides agree."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name in MIXER_CASES:
        cls, kwargs, kind, dtype = MIXER_CASES[name]
        module = getattr(lib, cls)(D_IN, H, **kwargs)
    else:
        kwargs, kind = STACK_CASES[name]
        dtype = "float64"
        module = lib.MinGRUStack(D_IN, H, 2, **kwargs)
    dtype = getattr(torch, dtype)
    return module.to(dtype), make_inputs(kind, dtype, gen)


def main(seed_dir, out):
    sys.path.insert(0, os.path.abspath(seed_dir))
    os.environ["MINGRU_SCAN"] = "eager"
    import warnings

    import mingru
    if not os.path.abspath(mingru.__file__).startswith(os.path.abspath(seed_dir)):
        raise SystemExit(f"imported mingru from {mingru.__file__}, not from {seed_dir}")
    warnings.simplefilter("ignore")
    saved = {}
    for name in [*MIXER_CASES, *STACK_CASES]:
        module, (x, w, dt) = build(mingru, name)
        saved[name] = {"state_dict": module.state_dict(), "x": x, "w": w, "dt": dt,
                       **run_case(module, x, w, dt, name in STACK_CASES)}
    torch.save(saved, out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
