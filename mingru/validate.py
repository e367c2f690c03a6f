"""Input checks shared by the public ops: clear errors instead of wrong answers."""
import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # every op's dtypes, kernels included
BLOCK_SIZES = (1, 2, 4, 8, 16)  # the k and v the matrix kernels are compiled for (others run eager)
OPTIONAL = ("h0", "bias", "scale")  # the ops' arguments that may be None; every other one is required


def data_checkable(x):
    """Whether a check may read x's values: on a CPU, outside torch.compile (elsewhere reading them
    costs a device sync or a graph break, so such checks are skipped or made on the device)."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def check_tensors(op, **tensors):
    """Every named tensor: a dense torch.Tensor of a floating dtype (None only for the OPTIONAL
    names); all on one device, one dtype."""
    first = None
    for name, x in tensors.items():
        if x is None:
            if name in OPTIONAL:
                continue
            raise TypeError(f"{op}: {name} is required (a torch.Tensor), got None")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
        if x.layout != torch.strided:
            raise TypeError(f"{op}: {name} has layout {x.layout}; expected a dense (strided) tensor, "
                            "e.g. x.to_dense()")
        if x.dtype not in FLOATS:
            raise TypeError(f"{op}: {name} has dtype {x.dtype}; expected float16, bfloat16, "
                            "float32 or float64")
        if first is None:
            first = (name, x)
            continue
        fname, fx = first
        if x.device != fx.device:
            raise ValueError(f"{op}: {name} is on {x.device} but {fname} is on {fx.device}; "
                             "put them on one device")
        if x.dtype != fx.dtype:
            raise TypeError(f"{op}: {name} has dtype {x.dtype} but {fname} has {fx.dtype}; "
                            "pass one dtype")


def check_sizes(owner, **sizes):
    """Every named size must be a positive int (a bool is not a size)."""
    for name, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{owner}: {name} must be a positive int, got {v!r}")


def check_flag(owner, **flags):
    """Every named constructor switch must be a bool."""
    for name, v in flags.items():
        if not isinstance(v, bool):
            raise TypeError(f"{owner}: {name} must be True or False, got {v!r}")


def check_state(owner, name, h, x):
    """A given state beside the input x: a floating-point tensor on x's device of x's dtype (under
    autocast, of any floating dtype: the mixer casts it). Its shape is the caller's check."""
    if not torch.is_floating_point(h):
        raise TypeError(f"{owner}: {name} must be a floating-point tensor of x's dtype {x.dtype}, got {h.dtype}")
    if h.device != x.device:
        raise ValueError(f"{owner}: {name} is on {h.device} but x is on {x.device}; put them on one device")
    if h.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(f"{owner}: {name} has dtype {h.dtype} but x has {x.dtype}; pass one dtype")


def check_input(owner, x, module, step, size, size_name="input_size"):
    """A module's input: a floating-point tensor of shape (B, T, size) ((B, size) for a step), on
    the device of the module's parameters and of their dtype, unless autocast is on for x's device
    (it casts the projections' inputs itself)."""
    want = f"(B, {size_name})" if step else f"(B, T, {size_name})"
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{owner}: x must be a floating-point torch.Tensor of shape {want}, "
                        f"got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() != (2 if step else 3) or x.shape[-1] != size:
        raise ValueError(f"{owner}: x must have shape {want} with {size_name} = {size}, got {tuple(x.shape)}")
    param = next(module.parameters(), None)
    if param is None:
        return
    if x.device != param.device:
        raise ValueError(f"{owner}: x is on {x.device} but the parameters are on {param.device}; move x "
                         f"there, or the module with .to('{x.device}')")
    if x.dtype != param.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(f"{owner}: x has dtype {x.dtype} but the parameters are {param.dtype}; pass x as "
                        f"{param.dtype} or convert the module with .to({x.dtype})")


_passed = {}  # argument signatures `checked` has accepted -> their named sizes
_PASSED_MAX = 4096


def checked(op, specs):
    """check_tensors and check_shapes of one op's arguments (specs as check_shapes, with a fixed
    list of expected shapes per op name); returns the named sizes, which callers must not modify.

    An accepted signature (each argument's shape, dtype and device, or None) is remembered, so a
    repeated call costs one lookup; anything else runs the full checks, which raise as they do
    alone. Under torch.compile the checks always run (the compiler traces them once anyway)."""
    if torch.compiler.is_compiling():
        return _check_all(op, specs)
    key = [op]
    for _, x, _ in specs:
        if x is None:
            key.append(None)
        elif isinstance(x, torch.Tensor):
            key += (x.shape, x.dtype, x.device, x.layout)
        else:
            return _check_all(op, specs)  # raises
    key = tuple(key)
    try:
        sizes = _passed.get(key)
    except TypeError:  # symbolic sizes (a tracer's dynamic shapes) do not hash
        return _check_all(op, specs)
    if sizes is None:
        sizes = _check_all(op, specs)
        if len(_passed) >= _PASSED_MAX:
            _passed.clear()
        _passed[key] = sizes
    return sizes


def _check_all(op, specs):
    check_tensors(op, **{name: x for name, x, _ in specs})
    return check_shapes(op, specs)


def check_shapes(op, specs):
    """specs: [(name, tensor, expected)]; named sizes must agree across all tensors."""
    sizes = {}
    for name, x, expected in specs:
        if x is not None:
            _match(op, name, x, expected, sizes)
    return sizes


def _match(op, name, x, expected, sizes):
    want = _Shape(expected)  # rendered only inside an error message: this runs on every call
    if x.dim() != len(expected):
        raise ValueError(f"{op}: {name} must have shape {want}, got {tuple(x.shape)} "
                         f"({x.dim()} dims, expected {len(expected)})")
    for dim, (got, exp) in enumerate(zip(x.shape, expected)):
        if isinstance(exp, int):
            if got != exp:
                raise ValueError(f"{op}: {name} must have shape {want}, got {tuple(x.shape)} "
                                 f"(dim {dim} is {got}, expected {exp})")
        elif exp.endswith("+1"):
            base = exp[:-2]
            if base in sizes and got != sizes[base] + 1:
                raise ValueError(f"{op}: {name} must have shape {want} with {base}+1 = "
                                 f"{sizes[base] + 1} in dim {dim}, got {tuple(x.shape)}")
        elif exp in sizes and sizes[exp] != got:
            raise ValueError(f"{op}: {name} has {exp} = {got} in dim {dim} but an earlier "
                             f"argument has {exp} = {sizes[exp]}; expected shape {want}")
        else:
            sizes[exp] = got
    return sizes


class _Shape(tuple):
    def __str__(self):
        return "(" + ", ".join(str(e) for e in self) + ")"
