"""A small language model on MinGRUStack, a generated selective-copy task, and a seeded training loop.

Selective copy: `n_data` data tokens sit at random positions among `seq_len` noise tokens; then
`n_data` marker tokens follow, and at the i-th marker the model must emit the i-th data token.
Only the marker positions carry a loss. A model that cannot select by content scores chance,
1 / (vocab - 2). Everything random (weights and batches) comes from the one `seed`, so two runs
that differ only in MINGRU_SCAN see the same weights and the same data.
"""
import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from mingru import dispatch
from mingru.blocks import MinGRUStack

NOISE, MARKER, IGNORE = 0, 1, -100


@dataclass(frozen=True)
class SelectiveCopy:
    """Token 0 is noise, 1 the marker, 2 .. vocab-1 the data; sequences are seq_len + n_data long."""
    seq_len: int = 32
    n_data: int = 4
    vocab: int = 10

    def __post_init__(self):
        if not (isinstance(self.vocab, int) and self.vocab >= 3):
            raise ValueError(f"SelectiveCopy: vocab must be an int >= 3 (noise, marker, data), got {self.vocab!r}")
        if not (isinstance(self.n_data, int) and 1 <= self.n_data <= self.seq_len):
            raise ValueError(f"SelectiveCopy: n_data must be an int in 1..seq_len = {self.seq_len}, "
                             f"got {self.n_data!r}")

    @property
    def length(self):
        return self.seq_len + self.n_data

    def batch(self, size, generator):
        """(inputs, targets), each (size, length) int64 on the CPU; targets are IGNORE off the markers."""
        places = torch.rand(size, self.seq_len, generator=generator).argsort(dim=1)[:, :self.n_data]
        places = places.sort(dim=1).values
        data = torch.randint(2, self.vocab, (size, self.n_data), generator=generator)
        inputs = torch.full((size, self.length), NOISE, dtype=torch.long)
        inputs.scatter_(1, places, data)
        inputs[:, self.seq_len:] = MARKER
        targets = torch.full_like(inputs, IGNORE)
        targets[:, self.seq_len:] = data
        return inputs, targets


class TinyLM(nn.Module):
    """Embedding -> MinGRUStack -> linear head. `forward` and `step` return (logits, stack state)."""

    def __init__(self, vocab, d_model=32, n_layers=2, mixer="log", mixer_kwargs=None, mlp_expansion=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.stack = MinGRUStack(d_model, d_model, n_layers, mlp_expansion=mlp_expansion, mixer=mixer,
                                 mixer_kwargs=mixer_kwargs)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens, state=None):
        """tokens (B, T) int64 -> (logits (B, T, vocab), per-block states for the next call)."""
        y, state = self.stack(self.embed(tokens), state)
        return self.head(y), state

    @torch.no_grad()
    def step(self, token, state=None):
        """token (B,) int64 -> (logits (B, vocab), state); state None starts a fresh sequence."""
        y, state = self.stack.step(self.embed(token), self.stack.init_state() if state is None else state)
        return self.head(y), state


def build(task, seed, device="cpu", **config):
    """A TinyLM for `task`, its weights drawn from `seed` alone (so every build with one seed is equal)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyLM(task.vocab, **config)
    return model.to(device)


def copy_loss(logits, targets):
    """Mean cross entropy over the marker positions, computed in float32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


def copy_accuracy(logits, targets):
    """Fraction of marker positions whose arg-max token is the target."""
    mask = targets != IGNORE
    return (logits.argmax(-1)[mask] == targets[mask]).float().mean().item()


def decode(model, tokens, state=None):
    """Run `model.step` token by token: logits (B, T, vocab) and the final state, as `forward` gives."""
    logits = []
    for t in range(tokens.shape[1]):
        out, state = model.step(tokens[:, t], state)
        logits.append(out)
    return torch.stack(logits, dim=1), state


def forward_chunks(model, tokens, chunk, detach=True):
    """`forward` over `tokens` in pieces of `chunk` steps, each starting from the last one's state.

    With detach=True the state crosses a chunk boundary without its gradient (truncated backprop).
    """
    if not (isinstance(chunk, int) and chunk >= 1):
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    logits, state = [], None
    for start in range(0, tokens.shape[1], chunk):
        out, state = model(tokens[:, start:start + chunk], state)
        if detach:
            state = [s.detach() for s in state]
        logits.append(out)
    return torch.cat(logits, dim=1), state


@dataclass
class TrainRun:
    """Per-step losses, the final batch's accuracy, and the throughput after the warm-up steps
    (`seconds` timed them; `warmup_s` is the time of the warm-up steps, a compiled model's compile included)."""
    losses: list = field(default_factory=list)
    accuracy: float = float("nan")
    tokens_per_s: float = float("nan")
    seconds: float = 0.0
    warmup_s: float = 0.0


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def train(model, task, steps, batch, seed=0, lr=3e-3, scan=None, autocast=None, tbptt=None, warmup=1):
    """Train `model` with Adam on `steps` batches drawn from `seed`; returns a TrainRun.

    scan: a MINGRU_SCAN mode for the run (None keeps the environment's). autocast: a dtype such
    as torch.bfloat16 for torch.autocast. tbptt: a chunk length for truncated backprop (the
    gradients of all chunks of a batch are summed into one optimizer step). Tokens per second
    count batch * length tokens per step, timed over the steps after the first `warmup`
    (which include compilation).
    """
    if not (isinstance(steps, int) and steps > warmup >= 0):
        raise ValueError(f"steps must be an int > warmup = {warmup}, got {steps!r}")
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    run, t0, losses = TrainRun(), None, []
    cast = (torch.autocast(device.type, dtype=autocast) if autocast is not None
            else contextlib.nullcontext())
    with dispatch.using(scan) if scan else contextlib.nullcontext():
        begin = time.perf_counter()
        for i in range(steps):
            if i == warmup:
                _sync(device)
                t0 = time.perf_counter()
                run.warmup_s = t0 - begin
            inputs, targets = (t.to(device) for t in task.batch(batch, gen))
            opt.zero_grad(set_to_none=True)
            chunk = tbptt or inputs.shape[1]
            loss, state, n = 0.0, None, (targets != IGNORE).sum()
            for start in range(0, inputs.shape[1], chunk):
                piece = slice(start, start + chunk)
                with cast:
                    logits, state = model(inputs[:, piece], state)
                state = [s.detach() for s in state]
                mask = targets[:, piece] != IGNORE
                if not mask.any():
                    continue
                part = copy_loss(logits, targets[:, piece]) * mask.sum() / n
                part.backward()
                loss += part.detach()
            opt.step()
            losses.append(loss)
        _sync(device)
        run.seconds = time.perf_counter() - t0
        with torch.no_grad(), cast:
            run.accuracy = copy_accuracy(model(inputs)[0], targets)
    run.losses = [float(x) for x in losses]  # one host sync, after the timed loop
    run.tokens_per_s = (steps - warmup) * batch * task.length / run.seconds
    return run


def first_step(model, task, batch, seed=0, scan=None):
    """The loss and the flattened parameter gradient of `train`'s first step (its batch, the model's
    weights as they are). Two paths of one model compared here differ by their rounding alone:
    after that first step Adam feeds every difference back into the weights, and it scales a tiny
    gradient to a full step, so loss curves drift apart where gradients agree."""
    device = next(model.parameters()).device
    inputs, targets = (t.to(device) for t in task.batch(batch, torch.Generator().manual_seed(seed)))
    model.zero_grad(set_to_none=True)
    with dispatch.using(scan) if scan else contextlib.nullcontext():
        loss = copy_loss(model(inputs)[0], targets)
        loss.backward()
    return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@dataclass(frozen=True)
class Demo:
    """The sizes of the chapter that trains every mixer in a TinyLM ("Using the mixers").

    `kernel_*` are the runs that compare MINGRU_SCAN=eager with triton, or Givens' two paths: on a
    CPU the interpreter runs those kernels in Python, so they get a smaller model there.
    """
    task: SelectiveCopy
    model: dict
    batch: int
    steps: int
    kernel_model: dict
    kernel_batch: int
    kernel_steps: int

    @property
    def chunk(self):
        """The truncated-backprop chunk: a third of a sequence, so the markers sit in the last chunk."""
        return self.task.length // 3


DEMO_MIXERS = ("log", "signed", "rotation", "givens", "delta")
DEMO_MIXER_KWARGS = {"givens": dict(block_size=8, rounds=3)}


def demo(on_gpu):
    """The chapter's sizes: a GPU's, or tiny ones that the interpreter trains in seconds."""
    if on_gpu:
        model = dict(d_model=128, n_layers=4)
        return Demo(SelectiveCopy(seq_len=256, n_data=8, vocab=16), model, 64, 150, model, 64, 100)
    return Demo(SelectiveCopy(seq_len=16, n_data=2, vocab=6), dict(d_model=32, n_layers=2), 32, 40,
                dict(d_model=16, n_layers=1), 2, 6)


def demo_runs(device):
    """(kind, arg, device) for each of the chapter's GPU runs that compiles something: what the
    compile pool of `make reproduce` runs ahead (`warm_run`), longest first."""
    runs = [("compiled", None), *[("mixer", m) for m in DEMO_MIXERS], ("scan", "triton"),
            ("givens", True), ("givens", False), ("bfloat16", None), ("tbptt", None)]
    return [(kind, arg, str(device)) for kind, arg in runs]


def warm_run(kind, arg, device):
    """Two steps of one of the chapter's GPU runs (`demo_runs`), results discarded: the kernels it
    launches land in Triton's on-disk cache and the compiled model's graphs in inductor's FX graph
    cache, which the chapter then reads instead of compiling."""
    d = demo(True)
    model, batch, scan, tbptt = d.model, d.batch, None, None
    mixer = arg if kind == "mixer" else "log"
    kwargs = DEMO_MIXER_KWARGS.get(mixer)
    if kind in ("scan", "givens"):  # the runs through MINGRU_SCAN=triton at the kernel sizes
        model, batch, scan = d.kernel_model, d.kernel_batch, "triton"
    if kind == "givens":
        mixer, kwargs = "givens", dict(DEMO_MIXER_KWARGS["givens"], fused=arg)
    net = build(d.task, 0, device, mixer=mixer, mixer_kwargs=kwargs, **model)
    if kind == "bfloat16":
        net = net.to(torch.bfloat16)
    elif kind == "compiled":
        net, scan = torch.compile(net, backend="inductor"), "triton"
    elif kind == "tbptt":
        tbptt = d.chunk
    train(net, d.task, 2, batch, scan=scan, tbptt=tbptt)


def loss_figure(curves, title):
    """One axis of loss per optimizer step, a line per label in `curves` ({label: TrainRun or list})."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, (label, curve) in enumerate(curves.items()):
        losses = curve.losses if isinstance(curve, TrainRun) else curve
        ax.plot(range(1, len(losses) + 1), losses, label=label, lw=2.4 - 0.5 * (i % 3),
                ls=("-", "--", ":")[i % 3])
    ax.set(title=title, xlabel="optimizer step", ylabel="cross entropy at the markers (nats)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    plt.close(fig)
    return fig
