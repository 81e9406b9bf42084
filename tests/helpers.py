"""Shared loop runners: run a training step under an entry point, compare with eager."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch._dynamo.compiled_autograd as ca
from torch._dynamo.utils import counters

import ca_dynsaved
from ca_dynsaved import _install

STEPS = 12


def scale_args(step: int) -> tuple[int, int, float, float]:
    """12 distinct values per saved slot, 0 and 1 included for ints and floats."""
    return step, 1 - step, step / 2, 1.0 - step / 4


@dataclass(frozen=True)
class Counts:
    captures: int
    compiles: int
    graph_breaks: int


#: The release CI runs the whole suite on (the README's): where a stock baseline that
#: costs a minute or more runs, asserted; elsewhere its measured figure is kept.
WHOLE_SUITE_RELEASE = "2.13"


def on_whole_suite_release() -> bool:
    return torch.__version__.startswith(WHOLE_SUITE_RELEASE + ".")


def this_release(expected: dict[str, Any]) -> Any:
    """The value for the running torch release from ``{"2.11": ..., "2.15": ...}``:
    a stock baseline that differs between releases is asserted per release, and a
    release with no measured value fails here instead of passing on a guess."""
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert release in expected, f"no expected value measured on torch {release}: {expected}"
    return expected[release]


def counts() -> Counts:
    return Counts(
        captures=counters["compiled_autograd"]["captures"],
        compiles=counters["stats"]["unique_graphs"],
        graph_breaks=sum(counters["graph_break"].values()),
    )


def stock_enable(
    backend: str = "aot_eager",
    fullgraph: bool = False,
    *,
    capture_dynamic: bool = True,
    **compile_kwargs: Any,
) -> Any:
    """Stock compiled autograd compiling with ``torch.compile(graph, backend=...,
    fullgraph=..., **compile_kwargs)``; ``capture_dynamic`` is ``_enable``'s own."""
    return torch._dynamo.compiled_autograd._enable(
        lambda gm: torch.compile(gm, backend=backend, fullgraph=fullgraph, **compile_kwargs),
        capture_dynamic,
    )


def stock_counts(
    step_fn: Callable[[int], tuple[Any, ...]], steps: int, enable: Callable[[], Any] = stock_enable
) -> Counts:
    """Stock CA's counts for ``steps`` steps of ``step_fn`` (each checked against
    eager; ``enable``: stock's context), then a fresh process's state again for what
    the test runs next."""
    run_loop(step_fn, enable, steps=steps)
    found = counts()
    ca_dynsaved.reset()
    counters.clear()
    return found


def assert_grads_equal(got: Iterable[Any], want: Iterable[Any], equal_nan: bool = False) -> None:
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None
        else:
            torch.testing.assert_close(g, w, equal_nan=equal_nan)


def patched_state() -> tuple[Any, ...]:
    """Everything the plugin patches or CA keeps globally, to compare before/after."""
    compiler = torch._C._dynamo.compiled_autograd.set_autograd_compiler(None, False)
    torch._C._dynamo.compiled_autograd.set_autograd_compiler(*compiler)  # a read, undone
    config = torch._dynamo.config
    return (
        ca._enable,
        ca.AutogradCompilerInstance,
        ca.compiled_autograd_enabled,
        ca.in_compiled_autograd_region,
        ca.active_disable_ctx,
        ca.depth,
        compiler,
        config.compiled_autograd,
        getattr(config, ca_dynsaved.CONFIG_FLAG, "absent"),
        getattr(config, ca_dynsaved.CONFIG_PYTHON_POLICY, "absent"),
        tuple(_install._modes),
        torch.autograd.variable.Variable._execution_engine,
    )


def run_loop(
    step_fn: Callable[[int], tuple[Any, ...]],
    ctx_factory: Callable[[], Any],
    steps: int = STEPS,
) -> list[tuple[Any, ...]]:
    """Run ``step_fn(step)`` under ``ctx_factory()``; check each step against eager."""
    results = []
    for step in range(steps):
        with ctx_factory():
            got = step_fn(step)
        with torch._dynamo.compiled_autograd._disable():
            want = step_fn(step)
        assert_grads_equal(got, want)
        results.append(got)
    return results


def eager() -> Any:
    return contextlib.nullcontext()


ENTRY_POINTS = ("context", "decorator", "config")


@contextlib.contextmanager
def entry_point(
    kind: str, backend: str = "aot_eager", compile_kwargs: dict[str, Any] | None = None, **options: Any
):
    """Yield ``backward(loss)``: ``loss.backward()`` under one of the three entry points.

    ``compile_kwargs`` (``mode``, ``options``, ...) go to ``enable`` or, on the config
    path, to ``torch.compile``, which hands them on to the CA graph's compile.
    The config path runs backward from a torch.compile'd frame, where Dynamo
    records one graph break of its own (``Tensor.backward()``), as stock does.
    """
    compile_kwargs = compile_kwargs or {}
    if kind == "context":

        def backward(loss):
            with ca_dynsaved.enable(backend=backend, **compile_kwargs, **options):
                loss.backward()

        yield backward
    elif kind == "decorator":

        @ca_dynsaved.enable(backend=backend, **compile_kwargs, **options)
        def backward(loss):
            loss.backward()

        yield backward
    else:
        assert kind == "config" and not options
        flags = {"compiled_autograd": True, ca_dynsaved.CONFIG_FLAG: True}
        with torch._dynamo.config.patch(**flags):
            # torch.compile reads config.compiled_autograd when it wraps the function.
            @torch.compile(backend=backend, **compile_kwargs)
            def backward(loss):
                loss.backward()

            yield backward


def frame_breaks(kind: str) -> int:
    """Graph breaks outside the CA graph that an entry point adds (stock has them too)."""
    return 1 if kind == "config" else 0


def leaf_grad_step(apply: Callable[[torch.Tensor, int], torch.Tensor], size: int = 8):
    """``step(i)``: a fresh leaf ``x``, ``apply(x * 2, i).sum().backward()``, ``(x.grad,)``."""

    def step(i: int):
        x = torch.linspace(-1.0, 1.0, size, requires_grad=True)
        apply(x * 2, i).sum().backward()
        return (x.grad,)

    return step
