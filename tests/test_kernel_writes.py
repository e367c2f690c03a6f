"""What torch.compile believes each kernel writes, checked without a GPU.

Under torch.compile every launch goes through torch's mutation analysis of the kernel's Triton IR.
A tensor it wrongly counts as written is, to AOT autograd, an input mutated in place: copies at
best, and an error when the tensor is a leaf that requires grad. The analysis only needs Triton's
front end, so it runs here on the real kernels: in a fresh process (the kernels compiled, not
interpreted), every op runs forward and backward on CPU tensors with the launches recorded instead
of run, under the planner's layouts and the forced ones; each recorded launch must write only
tensors that the launcher itself allocated, never an op's input, output read back, or cotangent.
"""
import os
import subprocess
import sys

import pytest
import torch

torch_wrap = pytest.importorskip("torch._higher_order_ops.triton_kernel_wrap")
pytest.importorskip("triton")


def test_every_launch_writes_only_what_its_launcher_allocated():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, os.path.abspath(__file__)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=900)
    if done.returncode == 3:
        pytest.skip(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "launches checked" in done.stdout


def _written(kernel, kwargs):
    """Names of the tensor arguments torch's analysis counts as written (the API moved across versions)."""
    if hasattr(torch_wrap, "identify_accessed_tensors"):
        return {dep.name for dep in torch_wrap.identify_accessed_tensors(kernel, kwargs, {}).read_writes.writes}
    return set(torch_wrap.identify_mutated_tensors(kernel, kwargs, {}))


def _cases():
    """(name, op, inputs) with every input requiring grad; small shapes, CPU."""
    import mingru
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    p = lambda *s: torch.rand(*s, generator=g) * 0.9 + 0.05  # noqa: E731
    T = 37
    cases = {
        "linear_scan": (mingru.linear_scan, [r(2, T, 5), r(2, T, 5)]),
        "linear_recurrence": (mingru.linear_recurrence, [p(2, T, 5), r(2, T, 5), r(2, 5)]),
        "parallel_scan_log": (mingru.parallel_scan_log, [-p(2, T, 5), r(2, T + 1, 5)]),
        "gated_recurrence": (mingru.gated_recurrence, [r(2, T, 5), r(2, T, 5), p(2, 5)]),
        "gated_recurrence_stacked": (mingru.gated_recurrence_stacked, [r(2, T, 10), p(2, 5), r(10)]),
        "signed_recurrence_stacked": (mingru.signed_recurrence_stacked, [r(2, T, 15), r(2, 5), r(15)]),
        "matrix_scan": (mingru.matrix_scan, [r(2, T, 3, 2, 2) * 0.5, r(2, T, 3, 2)]),
        "matrix_affine_scan": (mingru.matrix_affine_scan, [r(2, T, 3, 4, 4) * 0.4, r(2, T, 3, 4, 2)]),
        "matrix_recurrence": (mingru.matrix_recurrence, [r(2, T, 3, 4, 4) * 0.4, r(2, T, 3, 4, 2), r(2, 3, 4, 2)]),
        "matrix_recurrence-wide": (mingru.matrix_recurrence, [r(1, 5, 2, 32, 32) * 0.1, r(1, 5, 2, 32, 32),
                                                              r(1, 2, 32, 32)]),
        "rotation_recurrence": (mingru.rotation_recurrence, [r(2, T, 3, 6, 4), p(2, T, 3), r(2, T, 3, 8), r(2, 3, 8)]),
    }
    from mingru import scans
    from mingru.dispatch import dispatch
    L = torch.randn(4, 64, 64, generator=g) * 0.1  # M = 64: the inverse's every block
    cases["unit_lower_solve"] = (lambda L, R: dispatch("unit_lower_solve", scans.unit_lower_solve, L, R),
                                 [L, r(4, 64, 3)])
    return {name: (op, [x.requires_grad_() for x in xs]) for name, (op, xs) in cases.items()}


def _storages(tensors):
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}


def main():
    import triton
    try:
        from triton.backends.compiler import GPUTarget
    except ImportError:
        print("this triton has no GPUTarget to generate IR for")
        sys.exit(3)

    class Target:  # the IR generator asks the active driver for its target; no GPU is needed
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    triton.runtime.driver.set_active(Target())
    from mingru.kernels import diagonal, layout, matrix, rotation, triangular, wide
    launches = []

    def record(kernel, grid, args, **more):
        launches.append((kernel, {**args, **more}))

    for module in (diagonal, matrix, rotation, triangular, wide):
        module.launch = record
    os.environ["TRITON_INTERPRET"] = "1"  # the dispatch seam takes CPU tensors to the (recorded) kernels
    os.environ["MINGRU_SCAN"] = "triton"
    layouts = [dict(), dict(tile=4, segments=3), dict(tile=4, lookback=True)]
    checked, problems = 0, []
    for name, (op, inputs) in _cases().items():
        for force in layouts if name.split("_")[0] in ("linear", "parallel", "gated", "matrix") else layouts[:1]:
            with layout.forced_layout(**force):
                launches.clear()
                outs = op(*inputs)
                outs = outs if isinstance(outs, tuple) else (outs,)
                forward = list(launches)
                cots = [torch.ones_like(o) for o in outs]
                launches.clear()
                torch.autograd.grad(outs, inputs, cots)
                backward = list(launches)
            for direction, calls, kept in (("forward", forward, inputs), ("backward", backward, [*inputs, *outs, *cots])):
                keep = _storages(kept)
                for kernel, kwargs in calls:
                    bad = sorted(arg for arg in _written(kernel, kwargs)
                                 if isinstance(kwargs.get(arg), torch.Tensor) and _storages([kwargs[arg]]) & keep)
                    if bad:
                        problems.append(f"{name} {direction} {force}: {kernel.fn.__name__} is seen to write {bad}")
                    checked += 1
    assert not problems, "\n".join(problems)
    print(f"{checked} launches checked")


if __name__ == "__main__":
    main()
