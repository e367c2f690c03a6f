"""The cases of the differential tests against mingru-scans 0.2.0, and the script that runs them.

`python tests/seedrun.py SEED_DIR OUT` imports the published package from SEED_DIR (it is also
called `mingru`, so it runs in its own process), builds every case with a fixed seed, and saves
the state_dict, inputs, outputs and gradients of each to OUT with torch.save. `run_case` and
`run_delta` are shared with the tests (the `seed_results` fixture), which repeat each case on our
package from the saved state_dict.
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


# DeltaMinGRU with an explicit h_0 and a cotangent on the returned state: forward (return_state=True)
# and backward, then a step loop from h_0. NaN and negative gaps in delta_t are cleaned to 0 (the
# seed's documented rule).
DELTA_CASES = {
    "deltanet-h0": dict(input_size=6, hidden_size=8, n_heads=2, chunk_size=4),
    "deltaproduct-fixed": dict(input_size=6, hidden_size=8, n_heads=2, nh=2, chunk_size=3, decay="fixed",
                               decay_rate=0.5),
    "dk3-dv5-nobias-learnable-log1p": dict(input_size=6, hidden_size=6, n_heads=3, d_k=3, d_v=5, bias=False,
                                           decay="learnable", log1p_delta=True),
}


def delta_inputs(name):
    """x, h_0, delta_t and the cotangents of DELTA_CASES[name], seeded by its position."""
    kwargs = DELTA_CASES[name]
    g = torch.Generator().manual_seed(list(DELTA_CASES).index(name))
    B_, T_ = 2, 10
    n_heads = kwargs["n_heads"]
    d_k = kwargs.get("d_k", kwargs["hidden_size"] // n_heads)
    state = n_heads * d_k * kwargs.get("d_v", d_k)
    delta_t = None
    if kwargs.get("decay"):
        delta_t = 2 * torch.rand(B_, T_, generator=g)
        delta_t[0, 3], delta_t[1, 6] = float("nan"), -1.0
    return dict(x=torch.randn(B_, T_, kwargs["input_size"], generator=g),
                h_0=0.3 * torch.randn(B_, 1, state, generator=g), delta_t=delta_t,
                gy=torch.randn(B_, T_, kwargs["hidden_size"], generator=g),
                gh=torch.randn(B_, 1, state, generator=g))


def run_delta(module, case):
    """Outputs, state and gradients of the forward, and the step loop's outputs and last state."""
    x = case["x"].clone().requires_grad_()
    module.zero_grad()
    y, h = module(x, h_0=case["h_0"], delta_t=case["delta_t"], return_state=True)
    ((y * case["gy"]).sum() + (h * case["gh"]).sum()).backward()
    res = {"y": y.detach(), "h": h.detach(), "dx": x.grad}
    res.update({"d." + n: p.grad for n, p in module.named_parameters()})
    with torch.no_grad():
        h_t, ys = case["h_0"][:, 0], []
        for t in range(x.shape[1]):
            y_t, h_t = module.step(x[:, t].detach(), h_t, None if case["delta_t"] is None else case["delta_t"][:, t])
            ys.append(y_t)
    res.update(y_step=torch.stack(ys, 1), h_step=h_t)
    return res


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
    for name, kwargs in DELTA_CASES.items():
        torch.manual_seed(0)
        module = mingru.DeltaMinGRU(**kwargs)
        saved["delta:" + name] = {"state_dict": module.state_dict(), **run_delta(module, delta_inputs(name))}
    torch.save(saved, out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
