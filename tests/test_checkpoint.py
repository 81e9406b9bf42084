"""Activation checkpointing under the plugin: one CA graph, no break, eager's gradients.

Stock CA breaks its graph at every unpack of a non-reentrant checkpoint's saved
tensor (Dynamo skips ``torch.utils.checkpoint``'s hook) and at every reentrant
``CheckpointFunction.backward``; the plugin unpacks through ``ca_dynsaved::unpack``
and runs ``CheckpointFunction`` opaque (``checkpoint.py``). Each test counts the
recomputations (the block's forward run during backward) against eager's, and
asserts stock's counts beside the plugin's, per release.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable

import pytest
import torch
import torch.utils.checkpoint as cp
from torch._dynamo.utils import counters

import ca_dynsaved
from ca_dynsaved import checkpoint, decision
from ca_dynsaved.binding import bound_run
from helpers import (
    Counts, assert_grads_equal, counts, entry_point, frame_breaks, on_whole_suite_release, stock_enable, this_release,
)

STEPS = 6


class Scale(torch.autograd.Function):
    """A ctx float new every step, inside the checkpointed region: the recomputation
    runs its forward again and saves the new value again."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, s: float) -> torch.Tensor:
        ctx.s = s
        return x * s

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.s, None


def _selective(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> cp.CheckpointPolicy:
    save = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return cp.CheckpointPolicy.MUST_SAVE if save else cp.CheckpointPolicy.PREFER_RECOMPUTE


def _wrapped(block: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return checkpoint_wrapper(_Call(block))(*args)


class _Call(torch.nn.Module):
    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> torch.Tensor:
        return self.fn(*args)


#: How a block is checkpointed, by name.
KINDS: dict[str, Callable[..., torch.Tensor]] = {
    "none": lambda block, *a: block(*a),
    "non-reentrant": lambda block, *a: cp.checkpoint(block, *a, use_reentrant=False),
    "reentrant": lambda block, *a: cp.checkpoint(block, *a, use_reentrant=True),
    "checkpoint_wrapper": _wrapped,
    "nested": lambda block, *a: cp.checkpoint(
        lambda *b: cp.checkpoint(block, *b, use_reentrant=False), *a, use_reentrant=False
    ),
    "selective": lambda block, *a: cp.checkpoint(
        block, *a, use_reentrant=False,
        context_fn=functools.partial(cp.create_selective_checkpoint_contexts, _selective),
    ),
    "debug": lambda block, *a: cp.checkpoint(block, *a, use_reentrant=False, debug=True),
    "no metadata": lambda block, *a: cp.checkpoint(block, *a, use_reentrant=False, determinism_check="none"),
}


class Blocks:
    """Three checkpointed blocks (Linear, tanh, a transposed copy, ``Scale`` with a
    float new every step, softmax), a leaf input; counts the blocks' forwards."""

    def __init__(self, kind: str, vary_batch: bool = False) -> None:
        torch.manual_seed(0)
        self.lins = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.kind = KINDS[kind]
        self.vary_batch = vary_batch
        self.forwards = 0

    def block(self, lin: torch.nn.Module, h: torch.Tensor, s: float) -> torch.Tensor:
        self.forwards += 1
        y = torch.tanh(lin(h))
        return Scale.apply(y.t().contiguous().t() * 2, s).softmax(-1)

    def loss(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = 4 + (step % 3 if self.vary_batch else 0)
        x = torch.randn(n, 8, generator=torch.Generator().manual_seed(step)).requires_grad_()
        h = x
        for lin in self.lins:
            h = self.kind(self.block, lin, h, 1.0 + 0.1 * step)
        return h.pow(2).sum(), x

    def params(self) -> list[torch.Tensor]:
        return list(self.lins.parameters())

    def step(self, i: int, backward: Callable[[torch.Tensor], None]) -> tuple[list[Any], int]:
        """One step: (the params' and input's gradients, the blocks' forwards during
        backward)."""
        for p in self.params():
            p.grad = None
        loss, x = self.loss(i)
        self.forwards = 0
        backward(loss)
        return [p.grad for p in self.params()] + [x.grad], self.forwards


def train(model: Blocks, backward: Callable[[torch.Tensor], None], steps: int = STEPS) -> Counts:
    """``steps`` steps under ``backward``, each checked against eager's gradients and
    recomputations; the counts."""
    ca_dynsaved.reset()
    counters.clear()
    for i in range(steps):
        got, recomputed = model.step(i, backward)
        with torch._dynamo.compiled_autograd._disable():
            want, eager_recomputed = model.step(i, lambda loss: loss.backward())
        assert_grads_equal(got, want)
        assert recomputed == eager_recomputed == (0 if model.kind is KINDS["none"] else 3)
    return counts()


def stock(loss: torch.Tensor) -> None:
    with stock_enable("aot_eager"):
        loss.backward()


def plugin(loss: torch.Tensor) -> None:
    with ca_dynsaved.enable(backend="aot_eager"):
        loss.backward()


#: (CA captures, unique graphs, graph breaks) of stock CA, 6 steps, aot_eager: a break
#: at each unpack (non-reentrant) or CheckpointFunction (reentrant), 3 blocks. The
#: same on every release (measured on 2.11 to 2.15).
RELEASES = ("2.11", "2.12", "2.13", "2.14", "2.15")
STOCK = {
    "none": Counts(1, 2, 0),
    "non-reentrant": Counts(1, 13, 15),
    "reentrant": Counts(1, 7, 4),
    "checkpoint_wrapper": Counts(1, 13, 15),
    "nested": Counts(1, 13, 15),
    "selective": Counts(1, 13, 15),
    "debug": Counts(1, 13, 15),
    "no metadata": Counts(1, 13, 15),
}


#: The kinds CI runs on every release: the unpack op's path and the reentrant one
#: (the other non-reentrant kinds take the same path; the whole suite runs them).
EVERY_RELEASE = ("non-reentrant", "reentrant")


@pytest.mark.parametrize(
    "kind",
    [pytest.param(k, marks=pytest.mark.every_release) if k in EVERY_RELEASE else k for k in KINDS if k != "no metadata"],
)
def test_checkpointed_blocks_compile_once_without_a_break(kind: str) -> None:
    """One capture, one compile, no break, for every way of checkpointing; stock's
    baseline beside it; each step's gradients and recomputations as eager's."""
    model = Blocks(kind)
    assert train(model, stock) == this_release(dict.fromkeys(RELEASES, STOCK[kind]))
    assert train(model, plugin) == Counts(1, 1, 0)
    report = ca_dynsaved.report()
    (capture,) = report.captures
    if kind == "reentrant":
        assert [n.handling for n in capture.nodes if n.name == "CheckpointFunction"] == ["opaque"] * 3
        assert capture.unpacks == 0
    elif kind != "none":
        assert capture.unpacks > 0 and capture.unpack_fallback == ""


@pytest.mark.parametrize("kind", ["non-reentrant", "reentrant"])
@pytest.mark.parametrize("entry", ["context", "decorator", "config"])
def test_every_entry_point(kind: str, entry: str) -> None:
    model = Blocks(kind)
    with entry_point(entry) as backward:
        found = train(model, backward)
    assert found == Counts(1, 1, frame_breaks(entry))  # the config path: the frame's own break at backward()


@pytest.mark.parametrize("kind", ["none", "non-reentrant", "reentrant"])
def test_batch_size_new_every_step(kind: str) -> None:
    """Sizes that change: the like tensors' sizes go dynamic as any input's (one
    recompile), as the same model without checkpointing."""
    assert train(Blocks(kind, vary_batch=True), plugin) == Counts(1, 2, 0)


@pytest.mark.every_release
def test_checkpoint_without_metadata_runs_as_stock() -> None:
    """``determinism_check="none"`` records no shape of the saved tensors: every run
    takes the capture's stock twin, with stock's counts and eager's gradients."""
    model = Blocks("no metadata")
    assert train(model, plugin) == this_release(dict.fromkeys(RELEASES, STOCK["no metadata"]))
    (capture,) = ca_dynsaved.report().captures
    assert "determinism_check='none'" in capture.unpack_fallback
    assert counters["ca_dynsaved"]["unpack_stock_runs"] == STEPS


@pytest.mark.slow
def test_inductor_keeps_eager_gradients() -> None:
    """Inductor may reuse an op output's buffer: an unpacked tensor that shares its
    storage (the transposed weight the Linear saves, a recomputed view) reaches it
    as a copy; the gradients stay eager's."""
    model = Blocks("non-reentrant")

    def backward(loss: torch.Tensor) -> None:
        with ca_dynsaved.enable(backend="inductor"):
            loss.backward()

    assert train(model, backward, steps=4) == Counts(1, 1, 0)


def _bound(hook: Callable[[Any], torch.Tensor]) -> Any:
    unpacks = checkpoint.Unpacks([(0, 0)], torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()))
    return bound_run([hook], [], packed=[None], unpacks=unpacks, keys=True)


@pytest.mark.every_release
def test_unpack_refuses_a_tensor_unlike_its_description() -> None:
    """The op's check: a hook that returns another shape than the frame recorded
    (what checkpoint's own check excludes) is a clear error, never a wrong-shaped
    tensor handed to a compiled graph."""
    like = torch.empty_strided((0, 4, 8), (1, 8, 1))
    with _bound(lambda _: torch.ones(4, 9)), pytest.raises(RuntimeError, match=r"returned \(4, 9\).*recorded \(4, 8\)"):
        checkpoint.unpack_now(like, 0, 0, 0)


@pytest.mark.every_release
def test_unpack_copies_what_it_does_not_own() -> None:
    """A tensor whose storage another tensor shares comes back as a copy with the
    declared strides; one it owns, as it is."""
    weight = torch.randn(8, 4)
    like = torch.empty_strided((0, 4, 8), (1, 1, 4))  # a transposed (8, 4)
    with _bound(lambda _: weight.t()):
        out = checkpoint.unpack_now(like, 0, 0, 0)
    assert out.stride() == (1, 4) and out.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
    torch.testing.assert_close(out, weight.t())
    with _bound(lambda _: torch.ones(4, 8)):
        owned = checkpoint.unpack_now(torch.empty_strided((0, 4, 8), (1, 8, 1)), 0, 0, 0)
    assert owned.stride() == (8, 1) and bool((owned == 1).all())


class SumOver(torch.autograd.Function):
    """Saves its input and a dim: the probe's stand-in dim (7) is out of range for
    the saved tensor, and inside a checkpoint the capture has CA's placeholder for
    it; both runs fail in fake tensor mode, which logs each failure at ERROR."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.dim = dim
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        return grad * 2 + x.sum(ctx.dim, keepdim=True) * 0, None


@pytest.fixture
def torch_records() -> Any:
    """Every record torch's loggers make (they do not propagate: a handler on each)."""
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    loggers = [
        logging.getLogger(name) for name, log in list(logging.Logger.manager.loggerDict.items())
        if isinstance(log, logging.Logger) and (name == "torch" or name.startswith("torch."))
    ]
    for log in loggers:
        log.addHandler(handler)
    yield records
    for log in loggers:
        log.removeHandler(handler)


@pytest.mark.every_release
@pytest.mark.parametrize("checkpointed", [False, True])
def test_probes_never_log_into_the_users_log(checkpointed: bool, torch_records: Any, caplog: Any, capfd: Any) -> None:
    """A probe that fails on its stand-ins (a dim of 7 on a 4-d tensor; inside a
    checkpoint, CA's placeholder for the unpacked tensor) puts no WARNING or ERROR
    line of torch's loggers in the user's log: what torch said goes to the plugin's
    log at DEBUG. The same failure outside a probe does log at ERROR (the check can
    fail)."""
    import logging

    caplog.set_level(logging.DEBUG, logger="ca_dynsaved")
    lin = torch.nn.Linear(5, 5)

    def step(i: int) -> list[Any]:
        x = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(i)).requires_grad_()
        block = lambda h: SumOver.apply(torch.tanh(lin(h)), i % 4)  # noqa: E731
        out = cp.checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
        out.sum().backward()
        return [lin.weight.grad, lin.bias.grad, x.grad]

    for i in range(3):
        lin.zero_grad(set_to_none=True)
        with ca_dynsaved.enable(backend="aot_eager"):
            got = step(i)
        lin.zero_grad(set_to_none=True)
        assert_grads_equal(got, step(i))
    assert [r for r in torch_records if r.levelno >= logging.WARNING] == []
    # torch's stderr handler: no ERROR line ("E1204 18:06:16.675000 ... fake_tensor.py")
    assert not re.search(r"^E\d{4} ", capfd.readouterr().err, re.MULTILINE)
    (node,) = ca_dynsaved.report().nodes
    assert node.handling == "opaque"
    if checkpointed:
        assert node.reason == decision.UNPACKED_AT_RUN_TIME
    else:
        assert node.reason == "ctx.dim needs its value (guard Eq(ctx.dim, 0))"
    assert any("a probe made torch log at ERROR" in r.getMessage() for r in caplog.records if r.name == "ca_dynsaved") != checkpointed
    # The control: the same failure outside a probe reaches torch's log at ERROR.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), pytest.raises(IndexError):
        torch.empty(2, 3, 4, 5).sum(7)
    assert any(r.levelno == logging.ERROR for r in torch_records)


@pytest.mark.every_release
def test_cpp_function_inside_a_checkpoint(ext: Any) -> None:
    """A C++ toInt()/toDouble() reader inside a checkpointed region: its saved tensor
    is CA's placeholder at capture, so it runs opaque (no probe on the placeholder),
    one compile and no break where stock breaks at the unpack and recompiles per
    value; eager's gradients every step."""
    lin = torch.nn.Linear(8, 8)

    def step(i: int) -> list[Any]:
        lin.zero_grad(set_to_none=True)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i)).requires_grad_()
        block = lambda h: ext.scale_traceable(torch.tanh(lin(h)), i, 1, 1.0 + i / 10, 0.05)  # noqa: E731
        cp.checkpoint(block, x, use_reentrant=False).sum().backward()
        return [lin.weight.grad, lin.bias.grad, x.grad]

    modes = {"stock": lambda: stock_enable("aot_eager"), "plugin": lambda: ca_dynsaved.enable(backend="aot_eager")}
    if not on_whole_suite_release():  # stock's recompiles are this test's cost: measured the same on 2.11-2.15
        del modes["stock"]
    found = {}
    for name, backward in modes.items():
        ca_dynsaved.reset()
        counters.clear()
        for i in range(STEPS):
            with backward():
                got = step(i)
            assert_grads_equal(got, step(i))
        found[name] = counts()
    if "stock" in found:
        assert found.pop("stock") == this_release(dict.fromkeys(RELEASES, Counts(1, 10, 10)))
    assert found == {"plugin": Counts(1, 1, 0)}
    (node,) = ca_dynsaved.report().nodes
    assert (node.handling, node.reason) == ("opaque", decision.UNPACKED_AT_RUN_TIME)
