"""Bad input gets a clear error naming the op, the argument and what was expected."""
import pytest
import torch

import mingru

f32 = dict(dtype=torch.float32)


def r(*shape, **kw):
    return torch.randn(*shape, **{**f32, **kw})


CASES = [
    # (id, op, args, exception, words the message must contain)
    ("linear-rank", mingru.linear_scan, lambda: (r(2, 5), r(2, 5)), ValueError, ["linear_scan", "a", "(B, T, D)"]),
    ("linear-mismatch-T", mingru.linear_scan, lambda: (r(2, 5, 3), r(2, 6, 3)), ValueError, ["b", "T = 6", "T = 5"]),
    ("linear-mismatch-B", mingru.linear_scan, lambda: (r(2, 5, 3), r(3, 5, 3)), ValueError, ["b", "B = 3"]),
    ("linear-int", mingru.linear_scan, lambda: (torch.ones(2, 5, 3, dtype=torch.int64), r(2, 5, 3)), TypeError, ["a", "int64"]),
    ("linear-complex", mingru.linear_scan, lambda: (r(2, 5, 3), r(2, 5, 3).to(torch.complex64)), TypeError, ["b", "complex64"]),
    ("linear-dtypes", mingru.linear_scan, lambda: (r(2, 5, 3), r(2, 5, 3).double()), TypeError, ["b", "float64", "float32"]),
    ("linear-not-tensor", mingru.linear_scan, lambda: ([[1.0]], r(2, 5, 3)), TypeError, ["a", "torch.Tensor"]),
    ("recurrence-h0", mingru.linear_recurrence, lambda: (r(2, 5, 3), r(2, 5, 3), r(2, 4)), ValueError, ["h0", "D = 4"]),
    ("log-no-slot", mingru.parallel_scan_log, lambda: (r(2, 5, 3), r(2, 5, 3)), ValueError, ["log_values", "T+1 = 6"]),
    ("log-rank", mingru.parallel_scan_log, lambda: (r(2, 5, 3), r(6, 3)), ValueError, ["log_values", "(B, T+1, D)"]),
    ("matrix-not-2x2", mingru.matrix_scan, lambda: (r(2, 5, 3, 3, 3), r(2, 5, 3, 3)), ValueError, ["M", "(B, T, n, 2, 2)"]),
    ("matrix-n", mingru.matrix_scan, lambda: (r(2, 5, 3, 2, 2), r(2, 5, 4, 2)), ValueError, ["b", "n = 4"]),
    ("affine-not-square", mingru.matrix_affine_scan, lambda: (r(2, 5, 3, 4, 2), r(2, 5, 3, 4, 1)), ValueError, ["A", "k = 2", "k = 4"]),
    ("affine-k", mingru.matrix_affine_scan, lambda: (r(2, 5, 3, 4, 4), r(2, 5, 3, 2, 1)), ValueError, ["Bm", "k = 2"]),
    ("affine-rank", mingru.matrix_affine_scan, lambda: (r(2, 5, 3, 4, 4), r(2, 5, 3, 4)), ValueError, ["Bm", "(B, T, n, k, v)"]),
    ("stacked-odd", mingru.gated_recurrence_stacked, lambda: (r(2, 5, 7),), ValueError, ["kc", "(B, T, 2D)", "(2, 5, 7)"]),
    ("stacked-h0", mingru.gated_recurrence_stacked, lambda: (r(2, 5, 6), r(2, 4)), ValueError, ["h0", "(B, D)", "(2, 4)"]),
    ("stacked-bias", mingru.gated_recurrence_stacked, lambda: (r(2, 5, 6), r(2, 3), r(5)), ValueError,
     ["bias", "(2D)", "2D = 5"]),
    ("signed-parts", mingru.signed_recurrence_stacked, lambda: (r(2, 5, 7),), ValueError, ["kcs", "(B, T, 3D)", "(2, 5, 7)"]),
    ("signed-h0", mingru.signed_recurrence_stacked, lambda: (r(2, 5, 9), r(2, 4)), ValueError, ["h0", "(B, D)", "(2, 4)"]),
    ("signed-bias", mingru.signed_recurrence_stacked, lambda: (r(2, 5, 9), r(2, 3), r(6)), ValueError,
     ["bias", "(3D)", "3D = 6"]),
    ("signed-coupled", mingru.signed_recurrence_stacked, lambda: (r(2, 5, 9), None, None, "yes"), TypeError,
     ["coupled", "bool", "str"]),
    ("rotation-half", mingru.rotation_recurrence, lambda: (r(2, 5, 3, 2, 3), r(2, 5, 3), r(2, 5, 3, 4)), ValueError, ["angles", "k/2"]),
    ("rotation-decay", mingru.rotation_recurrence, lambda: (r(2, 5, 3, 2, 2), r(2, 5), r(2, 5, 3, 4)), ValueError, ["decay", "(B, T, n)"]),
    ("rotation-no-layers", mingru.rotation_recurrence, lambda: (r(1, 3, 1, 0, 1), r(1, 3, 1), r(1, 3, 1, 2)), ValueError,
     ["angles", "L >= 1"]),
    ("linear-none", mingru.linear_scan, lambda: (r(2, 5, 3), None), TypeError, ["linear_scan", "b is required"]),
    ("log-none", mingru.parallel_scan_log, lambda: (None, r(2, 6, 3)), TypeError, ["log_coeffs is required"]),
    ("rotation-none", mingru.rotation_recurrence, lambda: (r(2, 5, 3, 2, 2), None, r(2, 5, 3, 4)), TypeError,
     ["decay is required"]),
    ("stacked-none", mingru.gated_recurrence_stacked, lambda: (None,), TypeError, ["kc is required"]),
    ("linear-sparse", mingru.linear_scan, lambda: (r(2, 5, 3).to_sparse(), r(2, 5, 3)), TypeError, ["a", "sparse", "dense"]),
]


@pytest.mark.parametrize("op,make,exc,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
@pytest.mark.parametrize("mode", ["eager", "auto"])
def test_bad_input_is_named(monkeypatch, mode, op, make, exc, words):
    monkeypatch.setenv("MINGRU_SCAN", mode)
    with pytest.raises(exc) as info:
        op(*make())
    for word in words:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_devices_must_agree():
    with pytest.raises(ValueError, match="one device"):
        mingru.linear_scan(r(2, 5, 3), r(2, 5, 3, device="cuda"))


def test_devices_must_agree_meta():
    with pytest.raises(ValueError, match="b is on meta"):
        mingru.linear_scan(r(2, 5, 3), r(2, 5, 3, device="meta"))


@pytest.mark.parametrize("mixer", [mingru.MinGRU, mingru.SignedMinGRU, mingru.RotationMinGRU, mingru.GivensMinGRU])
def test_mixer_shape_errors(mixer):
    m = mixer(6, 16)
    with pytest.raises(ValueError, match="input_size = 6"):
        m(r(2, 5, 7))
    with pytest.raises(ValueError, match=r"\(B, 1, hidden_size\)"):
        m(r(2, 5, 6), r(2, 1, 15))
    with pytest.raises(ValueError, match=r"\(B, input_size\)"):
        m.step(r(2, 5, 6))


def test_mixer_bad_block_sizes():
    with pytest.raises(ValueError, match="divisible by block_size"):
        mingru.GivensMinGRU(4, 12, block_size=8)
    with pytest.raises(ValueError, match="hidden_size must be even"):
        mingru.RotationMinGRU(4, 7)
    with pytest.raises(ValueError, match="non-negative"):
        mingru.MinGRU(4, 8)(r(1, 3, 4), -torch.ones(1, 1, 8))


EMPTY = [  # (op, inputs with T = 0, the shapes of its outputs)
    (mingru.linear_scan, lambda: (r(2, 0, 3), r(2, 0, 3)), [(2, 0, 3), (2, 0, 3)]),
    (mingru.linear_recurrence, lambda: (r(2, 0, 3), r(2, 0, 3), r(2, 3)), [(2, 0, 3)]),
    (mingru.parallel_scan_log, lambda: (r(2, 0, 3), r(2, 1, 3)), [(2, 0, 3)]),
    (mingru.gated_recurrence, lambda: (r(2, 0, 3), r(2, 0, 3)), [(2, 0, 3)]),
    (mingru.gated_recurrence_stacked, lambda: (r(2, 0, 6),), [(2, 0, 3)]),
    (mingru.signed_recurrence_stacked, lambda: (r(2, 0, 9),), [(2, 0, 3)]),
    (mingru.matrix_scan, lambda: (r(2, 0, 3, 2, 2), r(2, 0, 3, 2)), [(2, 0, 3, 2, 2), (2, 0, 3, 2)]),
    (mingru.matrix_affine_scan, lambda: (r(2, 0, 3, 4, 4), r(2, 0, 3, 4, 2)), [(2, 0, 3, 4, 4), (2, 0, 3, 4, 2)]),
    (mingru.matrix_recurrence, lambda: (r(2, 0, 3, 4, 4), r(2, 0, 3, 4, 2), r(2, 3, 4, 2)), [(2, 0, 3, 4, 2)]),
    (mingru.rotation_recurrence, lambda: (r(2, 0, 3, 2, 2), r(2, 0, 3), r(2, 0, 3, 4)), [(2, 0, 3, 4)]),
]
# another axis empty, T > 0: the eager scan, in every mode (no kernel is built for a size of 0)
EMPTY_AXIS = [
    (mingru.matrix_recurrence, lambda: (r(2, 3, 2, 2, 2), r(2, 3, 2, 2, 0)), [(2, 3, 2, 2, 0)]),
    (mingru.matrix_affine_scan, lambda: (r(2, 3, 2, 2, 2), r(2, 3, 2, 2, 0)), [(2, 3, 2, 2, 2), (2, 3, 2, 2, 0)]),
    (mingru.linear_scan, lambda: (r(2, 3, 0), r(2, 3, 0)), [(2, 3, 0), (2, 3, 0)]),
    (mingru.rotation_recurrence, lambda: (r(2, 3, 0, 2, 2), r(2, 3, 0), r(2, 3, 0, 4)), [(2, 3, 0, 4)]),
]


@pytest.mark.parametrize("op,make,shapes", EMPTY, ids=[e[0].__name__ for e in EMPTY])
@pytest.mark.parametrize("mode", ["eager", "triton"])
def test_empty_sequence_gives_empty_outputs(monkeypatch, mode, op, make, shapes):
    """T == 0: outputs of the documented shapes in the inputs' dtype, and a backward that runs."""
    monkeypatch.setenv("MINGRU_SCAN", mode)
    inputs = [x.requires_grad_() for x in make()]
    outs = op(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    assert [tuple(o.shape) for o in outs] == shapes and all(o.dtype == torch.float32 for o in outs)
    torch.autograd.backward([o.sum() for o in outs])


@pytest.mark.parametrize("op,make,shapes", EMPTY_AXIS, ids=[e[0].__name__ for e in EMPTY_AXIS])
@pytest.mark.parametrize("mode", ["eager", "triton"])
def test_an_empty_axis_runs_the_eager_scan(monkeypatch, mode, op, make, shapes):
    monkeypatch.setenv("MINGRU_SCAN", mode)
    inputs = make()
    outs = op(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    assert [tuple(o.shape) for o in outs] == shapes
    with mingru.dispatch.using("eager"):
        want = op(*inputs)
    for got, exp in zip(outs, want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(got, exp, rtol=0, atol=0)


STATEFUL = [(mingru.MinGRU, (2, 1, 16), (2, 16)), (mingru.SignedMinGRU, (2, 1, 16), (2, 16)),
            (mingru.RotationMinGRU, (2, 1, 16), (2, 16)), (mingru.GivensMinGRU, (2, 1, 16), (2, 16)),
            (mingru.DeltaMinGRU, (2, 1, 64), (2, 64))]


@pytest.mark.parametrize("mixer,forward_shape,step_shape", STATEFUL, ids=[m[0].__name__ for m in STATEFUL])
def test_mixer_states_must_match_x(mixer, forward_shape, step_shape):
    """A given h_0 / h_prev of the right shape but another dtype, a non-float dtype or another device
    is named, never cast silently or run on garbage."""
    m = mixer(6, 16)
    x, x_t = r(2, 5, 6), r(2, 6)
    for call, arg, shape in ((lambda h: m(x, h), "h_0", forward_shape), (lambda h: m.step(x_t, h), "h_prev", step_shape)):
        with pytest.raises(TypeError, match=rf"{arg} must be a floating-point tensor"):
            call(torch.ones(shape, dtype=torch.long))
        with pytest.raises(TypeError, match=rf"{arg} has dtype torch.float64 but x has torch.float32"):
            call(torch.rand(shape, dtype=torch.float64))
        with pytest.raises(ValueError, match=rf"{arg} is on meta but x is on cpu"):
            call(torch.rand(shape, device="meta"))
        call(torch.rand(shape))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: a state in its dtype is accepted
        assert m(x, torch.rand(forward_shape).bfloat16()).dtype == torch.bfloat16


def test_delta_t_is_real_on_the_mixers_device_and_cast():
    m = mingru.MinGRU(3, 4, decay="fixed")
    x = r(2, 3, 3)
    with pytest.raises(ValueError, match="delta_t is on meta but the mixer is on cpu"):
        m(x, None, torch.rand(2, 3, device="meta"))
    with pytest.raises(TypeError, match="delta_t must be real"):
        m(x, None, torch.rand(2, 3).to(torch.complex64))
    dt = torch.rand(2, 3, dtype=torch.float64)
    assert m(x, None, dt).dtype == torch.float32
    torch.testing.assert_close(m(x, None, dt), m(x, None, dt.float()), rtol=0, atol=0)


def test_constructor_arguments_are_named():
    for bad in ("1", None, torch.tensor([1.0, 2.0])):
        with pytest.raises(TypeError, match="decay_rate must be a positive number"):
            mingru.MinGRU(3, 4, decay="fixed", decay_rate=bad)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="decay_rate must be > 0 and finite"):
            mingru.MinGRU(3, 4, decay="learnable", decay_rate=bad)
    big = mingru.MinGRU(3, 4, decay="learnable", decay_rate=1000.0)  # softplus^-1 without overflow
    torch.testing.assert_close(big._decay_lambda(), torch.full((4,), 1000.0))
    with pytest.raises(TypeError, match="SignedMinGRU: coupled must be True or False"):
        mingru.SignedMinGRU(3, 4, coupled="no")
    with pytest.raises(TypeError, match="GivensMinGRU: fused must be True or False"):
        mingru.GivensMinGRU(3, 4, block_size=2, fused="yes")
    with pytest.raises(ValueError, match="GivensMinGRU: rounds must be a positive int"):
        mingru.GivensMinGRU(3, 4, block_size=2, rounds=True)
    for bad in ((1.5,), 5, "246", ()):
        with pytest.raises(ValueError, match="snap must be None or a non-empty tuple of positive ints"):
            mingru.RotationMinGRU(3, 4, snap=bad)
    with pytest.raises(TypeError, match="mlp_expansion must be an int"):
        mingru.MinGRUBlock(4, mlp_expansion=0.5)
    assert mingru.MinGRUBlock(4, mlp_expansion=-1).mlp is None  # as in mingru-scans: 0 or less, no MLP
    with pytest.raises(ValueError, match="mixer must be one of"):
        mingru.MinGRUBlock(4, mixer=["log"])
    with pytest.raises(TypeError, match="MinGRUBlock: mixer_kwargs must be a dict"):
        mingru.MinGRUBlock(4, mixer_kwargs=[1, 2])
    with pytest.raises(TypeError, match="MinGRUStack: mixer_kwargs must be a dict"):
        mingru.MinGRUStack(3, 4, 2, mixer_kwargs="decay")
    with pytest.raises(TypeError, match="state must be a list of n_layers = 2"):
        mingru.MinGRUStack(3, 4, 2)(r(2, 3, 3), 5)


@pytest.mark.parametrize("mixer", [mingru.MinGRU, mingru.SignedMinGRU, mingru.RotationMinGRU, mingru.GivensMinGRU,
                                   mingru.DeltaMinGRU])
def test_mixer_x_dtype_must_match_its_parameters(mixer):
    m = mixer(6, 16)
    with pytest.raises(TypeError, match=r"x has dtype torch.float64 but the parameters are torch.float32"):
        m(r(2, 5, 6).double())
    with pytest.raises(TypeError, match=r"x has dtype torch.float64"):
        m.step(r(2, 6).double())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts the inputs itself
        m(r(2, 5, 6).bfloat16())


@pytest.mark.parametrize("mixer", [mingru.MinGRU, mingru.SignedMinGRU, mingru.RotationMinGRU, mingru.GivensMinGRU,
                                   mingru.DeltaMinGRU])
def test_mixer_x_must_be_on_the_parameters_device(mixer):
    m = mixer(6, 16)
    with pytest.raises(ValueError, match=r"x is on meta but the parameters are on cpu"):
        m(torch.empty(2, 5, 6, device="meta"))
    with pytest.raises(ValueError, match=r"x is on meta but the parameters are on cpu"):
        m.step(torch.empty(2, 6, device="meta"))


def test_blocks_and_stacks_name_their_input_shapes_and_sizes():
    block, stack = mingru.MinGRUBlock(8), mingru.MinGRUStack(6, 8, 2)
    with pytest.raises(ValueError, match=r"MinGRUBlock: x must have shape \(B, T, d_model\) with d_model = 8, got \(2, 5, 7\)"):
        block(r(2, 5, 7))
    with pytest.raises(ValueError, match=r"MinGRUBlock: x must have shape \(B, d_model\) with d_model = 8"):
        block.step(r(2, 5, 8))
    with pytest.raises(ValueError, match=r"MinGRUStack: x must have shape \(B, T, input_size\) with input_size = 6"):
        stack(r(2, 5, 8))
    with pytest.raises(ValueError, match=r"MinGRUStack: x must have shape \(B, input_size\) with input_size = 6"):
        stack.step(r(2, 8), stack.init_state())
    with pytest.raises(TypeError, match=r"MinGRUStack: x must be a floating-point torch.Tensor"):
        stack(torch.ones(2, 5, 6, dtype=torch.long))
    with pytest.raises(ValueError, match=r"MinGRUBlock: x is on meta"):
        block(torch.empty(2, 5, 8, device="meta"))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=r"MinGRUStack: n_layers must be a positive int"):
            mingru.MinGRUStack(6, 8, bad)
    with pytest.raises(ValueError, match=r"MinGRUBlock: d_model must be a positive int"):
        mingru.MinGRUBlock(0)


@pytest.mark.parametrize("mode", ["eager", "triton"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_inputs_are_not_clamped(monkeypatch, mode, bad):
    """A non-finite a at step 2: the states before it are the finite ones, the states from it on
    are non-finite (an inf may come out as NaN under the kernels: see `mingru.ops`)."""
    monkeypatch.setenv("MINGRU_SCAN", mode)
    a, b = torch.rand(2, 6, 3) + 0.5, r(2, 6, 3)
    a[:, 2] = bad
    with mingru.dispatch.using("eager"):
        want = mingru.linear_recurrence(a[:, :2], b[:, :2])
    h = mingru.linear_recurrence(a, b)
    torch.testing.assert_close(h[:, :2], want)
    assert not h[:, 2:].isfinite().any()
