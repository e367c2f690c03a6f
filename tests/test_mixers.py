"""Mixers and blocks: forward equals the step loop, h_0 chains two halves, the Triton kernels
(interpreter on CPU) agree with eager, and bad arguments get errors that name them."""
import copy

import pytest
import torch

import mingru

D_IN, H = 6, 16
MIXERS = {
    "MinGRU": lambda: mingru.MinGRU(D_IN, H),
    "MinGRU-h0-learnable-decay": lambda: mingru.MinGRU(D_IN, H, learnable_h0=True, decay="learnable"),
    "MinGRU-no-bias": lambda: mingru.MinGRU(D_IN, H, bias=False),  # the stacked projection without biases
    "SignedMinGRU-fixed-decay": lambda: mingru.SignedMinGRU(D_IN, H, decay="fixed", log1p_delta=True),
    "SignedMinGRU-coupled": lambda: mingru.SignedMinGRU(D_IN, H, coupled=True, learnable_h0=True),
    "RotationMinGRU": lambda: mingru.RotationMinGRU(D_IN, H, snap=None),
    "RotationMinGRU-snap-decay": lambda: mingru.RotationMinGRU(D_IN, H, decay="learnable"),
    "GivensMinGRU-k8": lambda: mingru.GivensMinGRU(D_IN, H),
    "GivensMinGRU-k4-r1-fixed-decay": lambda: mingru.GivensMinGRU(D_IN, H, block_size=4, rounds=1,
                                                                  decay="fixed"),
    "GivensMinGRU-k2-r2-learnable-decay": lambda: mingru.GivensMinGRU(D_IN, H, block_size=2, rounds=2,
                                                                      decay="learnable"),
    "GivensMinGRU-k4-generic-decay": lambda: mingru.GivensMinGRU(D_IN, H, block_size=4, fused=False,
                                                                 decay="learnable"),
}


@pytest.fixture(params=list(MIXERS.values()), ids=list(MIXERS))
def mixer(request):
    torch.manual_seed(0)
    return request.param()


def _inputs(mixer, B, T, dtype=torch.float32):
    x = torch.randn(B, T, D_IN, dtype=dtype)
    return x, (torch.rand(B, T, dtype=dtype) * 3 if mixer.decay else None)


def _at(dt, t):
    return None if dt is None else dt[:, t]


def test_forward_equals_steps(mixer, eager_mode):
    mixer.double()
    x, dt = _inputs(mixer, 3, 11, torch.float64)
    h, steps = None, []
    for t in range(x.shape[1]):
        h = mixer.step(x[:, t], h, _at(dt, t))
        steps.append(h)
    torch.testing.assert_close(mixer(x, None, dt), torch.stack(steps, 1))


def test_h0_chains_two_halves(mixer, eager_mode):
    x, dt = _inputs(mixer, 2, 10)
    whole = mixer(x, None, dt)
    first = mixer(x[:, :4], None, None if dt is None else dt[:, :4])
    second = mixer(x[:, 4:], first[:, -1:], None if dt is None else dt[:, 4:])
    torch.testing.assert_close(torch.cat([first, second], 1), whole, atol=1e-5, rtol=1e-5)


def test_backward_reaches_every_parameter(mixer, eager_mode):
    x, dt = _inputs(mixer, 2, 5)
    mixer(x, None, dt).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in mixer.parameters())


def test_triton_matches_eager(mixer, device, monkeypatch):
    """The kernels (interpreter on a CPU, the GPU on CUDA) give eager's outputs and gradients."""
    pytest.importorskip("triton")
    x, dt = _inputs(mixer, 2, 6)
    mixer, x, dt = mixer.to(device), x.to(device), None if dt is None else dt.to(device)
    results = []
    for mode in ("eager", "triton"):
        monkeypatch.setenv("MINGRU_SCAN", mode)
        mixer.zero_grad()
        xg = x.clone().requires_grad_(True)
        y = mixer(xg, None, dt)
        y.square().sum().backward()
        results.append([y, xg.grad] + [p.grad for p in mixer.parameters()])
    for eager, kernel in zip(*results):
        torch.testing.assert_close(kernel, eager, atol=1e-5, rtol=1e-4)


def test_givens_fused_and_generic_paths_agree(eager_mode):
    torch.manual_seed(0)
    fused = mingru.GivensMinGRU(D_IN, H, block_size=4, decay="fixed")
    generic = mingru.GivensMinGRU(D_IN, H, block_size=4, decay="fixed", fused=False)
    generic.load_state_dict(fused.state_dict())
    x, dt = _inputs(fused, 2, 9)
    torch.testing.assert_close(fused(x, None, dt), generic(x, None, dt))


def test_decay_zero_gap_is_no_decay(eager_mode):
    torch.manual_seed(0)
    plain = mingru.SignedMinGRU(D_IN, H)
    decayed = mingru.SignedMinGRU(D_IN, H, decay="learnable")
    decayed.load_state_dict(plain.state_dict(), strict=False)
    x = torch.randn(2, 5, D_IN)
    torch.testing.assert_close(decayed(x, None, torch.zeros(2, 5)), plain(x))
    assert not torch.allclose(decayed(x, None, torch.ones(2, 5)), plain(x))


def test_dirty_delta_t_is_cleaned_with_one_warning(eager_mode):
    torch.manual_seed(0)
    m = mingru.MinGRU(D_IN, H, decay="fixed")
    x = torch.randn(1, 4, D_IN)
    dirty = torch.tensor([[float("nan"), -2.0, float("-inf"), 0.5]])
    with pytest.warns(UserWarning, match="delta_t"):
        y = m(x, None, dirty)
    torch.testing.assert_close(y, m(x, None, torch.tensor([[0.0, 0.0, 0.0, 0.5]])))


@pytest.mark.parametrize("make, call, match", [
    (lambda: mingru.MinGRU(D_IN, H), lambda m: m(torch.randn(2, 3, D_IN + 1)), r"x must have shape \(B, T, input_size\)"),
    (lambda: mingru.MinGRU(D_IN, H), lambda m: m.step(torch.randn(2, 3, D_IN)), r"x must have shape \(B, input_size\)"),
    (lambda: mingru.MinGRU(D_IN, H), lambda m: m(torch.randn(2, 3, D_IN), torch.ones(2, H)), r"h_0 must have shape \(B, 1, hidden_size\)"),
    (lambda: mingru.MinGRU(D_IN, H), lambda m: m(torch.randn(2, 3, D_IN), -torch.ones(2, 1, H)), "non-negative"),
    (lambda: mingru.SignedMinGRU(D_IN, H), lambda m: m.step(torch.randn(2, D_IN), torch.ones(2, 1, H)), r"h_prev must have shape \(B, hidden_size\)"),
    (lambda: mingru.MinGRU(D_IN, H), lambda m: m(torch.randn(2, 3, D_IN), None, torch.ones(2, 3)), "decay=None"),
    (lambda: mingru.MinGRU(D_IN, H, decay="fixed"), lambda m: m(torch.randn(2, 3, D_IN)), "delta_t is required"),
    (lambda: mingru.RotationMinGRU(D_IN, H, decay="fixed"), lambda m: m(torch.randn(2, 3, D_IN), None, torch.ones(2, 4)), r"delta_t must have shape \(B, T\)"),
    (lambda: mingru.GivensMinGRU(D_IN, H, decay="fixed"), lambda m: m.step(torch.randn(2, D_IN), None, torch.ones(2, 2)), r"delta_t must have shape \(B,\)"),
    (lambda: mingru.GivensMinGRU(D_IN, 12), None, "divisible by block_size"),
    (lambda: mingru.GivensMinGRU(D_IN, H, block_size=3), None, "block_size must be an even"),
    (lambda: mingru.GivensMinGRU(D_IN, H, rounds=0), None, "rounds must be"),
    (lambda: mingru.RotationMinGRU(D_IN, 15), None, "hidden_size must be even"),
    (lambda: mingru.RotationMinGRU(D_IN, H, snap=()), None, "snap must be"),
    (lambda: mingru.MinGRU(D_IN, H, decay="exp"), None, "decay must be"),
    (lambda: mingru.MinGRU(D_IN, H, decay="learnable", decay_rate=0.0), None, "decay_rate must be > 0"),
    (lambda: mingru.MinGRUBlock(8, mixer="lstm"), None, "mixer must be one of"),
    (lambda: mingru.MinGRUStack(4, 8, 2, mixer=["log"]), None, "n_layers = 2"),
    (lambda: mingru.MinGRUStack(4, 8, 2, mixer="log", mixer_kwargs={"signed": {}}), None, "mixer names"),
    (lambda: mingru.MinGRUStack(4, 8, 2, decay_layers="first"), None, "decay_layers"),
    (lambda: mingru.MinGRUStack(4, 8, 2), lambda m: m(torch.randn(1, 3, 4), None, torch.ones(1, 3)), "decay=None"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_arguments_are_named(make, call, match, eager_mode):
    with pytest.raises(ValueError, match=match):
        m = make()
        call(m)


def test_empty_sequence(mixer, eager_mode):
    """T == 0 gives (B, 0, hidden_size), as mingru-scans does, and a backward that runs."""
    x, dt = _inputs(mixer, 2, 0)
    y = mixer(x.requires_grad_(), None, dt)
    assert tuple(y.shape) == (2, 0, H)
    y.sum().backward()


@pytest.mark.filterwarnings("ignore:2 'rotation' blocks")
@pytest.mark.parametrize("mixer", ["log", "signed", "rotation", "givens", "delta"])
def test_stack_keeps_its_state_over_an_empty_chunk(mixer, eager_mode):
    torch.manual_seed(0)
    stack = mingru.MinGRUStack(5, 8, 2, mixer=mixer)
    x = torch.randn(2, 4, 5)
    _, state = stack(x)
    y, same = stack(x[:, :0], state)
    assert tuple(y.shape) == (2, 0, 8)
    assert all(torch.equal(a, b) for a, b in zip(state, same))


def test_x_must_be_floating():
    with pytest.raises(TypeError, match="floating-point"):
        mingru.SignedMinGRU(D_IN, H)(torch.ones(2, 3, D_IN, dtype=torch.long))


@pytest.mark.filterwarnings("ignore:2 'rotation' blocks")
@pytest.mark.parametrize("mixer", ["log", "signed", "rotation", "givens"])
def test_stack_forward_step_and_chained_state_agree(mixer, eager_mode):
    torch.manual_seed(0)
    kwargs = {"block_size": 4, "decay": "learnable"} if mixer == "givens" else None
    stack = mingru.MinGRUStack(5, 8, 2, mixer=mixer, mixer_kwargs=kwargs).double()
    x = torch.randn(2, 6, 5, dtype=torch.float64)
    dt = torch.rand(2, 6, dtype=torch.float64) if kwargs else None
    y, state = stack(x, None, dt)
    first, carry = stack(x[:, :2], None, None if dt is None else dt[:, :2])
    second, _ = stack(x[:, 2:], carry, None if dt is None else dt[:, 2:])
    torch.testing.assert_close(torch.cat([first, second], 1), y)
    steps, s = [], stack.init_state()
    for t in range(6):
        out, s = stack.step(x[:, t], s, _at(dt, t))
        steps.append(out)
    torch.testing.assert_close(torch.stack(steps, 1), y)
    assert [tuple(h.shape) for h in state] == [(2, 1, 8)] * 2


def test_delta_block_carries_its_matrix_state(eager_mode):
    pytest.importorskip("mingru.delta")
    torch.manual_seed(0)
    block = mingru.MinGRUBlock(8, mixer="delta", mixer_kwargs={"n_heads": 2}).double()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    y, _ = block(x)
    first, carry = block(x[:, :3])
    second, _ = block(x[:, 3:], carry)
    torch.testing.assert_close(torch.cat([first, second], 1), y)
    steps, s = [], None
    for t in range(6):
        out, s = block.step(x[:, t], s)
        steps.append(out)
    torch.testing.assert_close(torch.stack(steps, 1), y)


@pytest.mark.parametrize("make", [lambda: mingru.MinGRU(8, 8), lambda: mingru.SignedMinGRU(8, 8),
                                  lambda: mingru.RotationMinGRU(8, 8), lambda: mingru.GivensMinGRU(8, 8, block_size=4),
                                  lambda: mingru.GivensMinGRU(8, 8, block_size=4, fused=False),
                                  lambda: mingru.DeltaMinGRU(8, 8, n_heads=2)],
                         ids=["log", "signed", "rotation", "givens", "givens-generic", "delta"])
def test_autocast_bfloat16_runs_in_one_dtype(make):
    """Under autocast the projections are bfloat16 while h0, decay and buffers are float32: the
    scan gets one dtype, and the result stays close to the float32 forward."""
    torch.manual_seed(0)
    mixer, x = make(), torch.randn(2, 5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mixer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), mixer(x), atol=0.1, rtol=0.1)


@pytest.mark.parametrize("autocast", [False, True], ids=["bfloat16", "autocast"])
def test_bfloat16_gradients_stay_as_close_to_float64_as_eager(autocast, device, monkeypatch):
    """In bfloat16 (or under autocast to it) the kernels' path, which runs MinGRU's projections as
    one stacked matmul, lands about as close to the float64 gradients as the eager path: within 5x
    of eager's error for the input and the candidate projection. Rounding x W before adding the bias
    flips the sign of pre-activations near 0, where g's slope jumps from 1/4 to 1; with the bias
    added after rounding, these three gradients were 15-23x farther from float64 than eager's here."""
    pytest.importorskip("triton")
    torch.manual_seed(4)
    B, T, d = 4, 64, 32
    mixer = mingru.MinGRU(d, d).to(device)
    with torch.no_grad():  # inputs and weights bfloat16 holds exactly: float64 sees what both paths see
        for p in mixer.parameters():
            p.copy_(p.bfloat16())
    x = torch.randn(B, T, d, device=device).bfloat16().float()
    cot = torch.randn(B, T, d, device=device)
    exact, x64 = copy.deepcopy(mixer).double(), x.double().requires_grad_()
    want = torch.autograd.grad(exact(x64), [x64, *exact.parameters()], cot.double())
    errors = {}
    for mode in ("eager", "triton"):
        monkeypatch.setenv("MINGRU_SCAN", mode)
        low = mixer if autocast else copy.deepcopy(mixer).bfloat16()
        xl = (x if autocast else x.bfloat16()).requires_grad_()
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
            y = low(xl)
        got = torch.autograd.grad(y, [xl, *low.parameters()], cot.to(y.dtype))
        errors[mode] = [(g.double() - w).abs().max().item() for g, w in zip(got, want)]
    names = ["x"] + [name for name, _ in mixer.named_parameters()]
    for name, eager, kernel in zip(names, errors["eager"], errors["triton"]):
        if name == "x" or name.startswith("linear_h"):
            assert kernel <= 5 * eager, f"{name}: kernels' path {kernel:.3g} from float64, eager's {eager:.3g}"


def test_default_states_are_made_on_the_inputs_device():
    """A default state made on the host and copied over would make every forward wait for the GPU
    (a blocking host-to-device copy synchronizes); the 'meta' device stands in for CUDA here."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class HostTensors(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tree_leaves((args, kwargs, out))):
                self.ops.append(func)
            return out

    x = torch.empty(2, 3, 4, device="meta")
    for mixer in (mingru.MinGRU(4, 4), mingru.SignedMinGRU(4, 4)):
        for step in (False, True):
            with HostTensors() as mode:
                h = mixer._state(None, x[:, 0] if step else x, step, mixer._default_h0)
            assert h.device.type == "meta" and not mode.ops, (type(mixer).__name__, step, mode.ops)
