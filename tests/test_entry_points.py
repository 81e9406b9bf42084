"""Context manager, decorator and config flag: same behaviour, stock restored after."""

from __future__ import annotations

import os
import pickle
import threading

import pytest
import torch
import torch._dynamo.compiled_autograd as ca

import ca_dynsaved
from ca_dynsaved import _install
from ca_dynsaved._compat import capture
from helpers import (
    ENTRY_POINTS,
    STEPS,
    Counts,
    assert_grads_equal,
    counts,
    entry_point,
    frame_breaks,
    patched_state,
    run_loop,
    scale_args,
    stock_enable,
)

#: The every-release subset (README, "Supported torch releases").
pytestmark = pytest.mark.every_release

PKG_DIR = os.path.dirname(ca_dynsaved.__file__)


def _forward(ext, i):
    x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
    return x, ext.scale_traceable(x * 2, *scale_args(i)).sum()


def _step_fn(ext):
    """``step(i)``: backward of ``_forward(ext, i)``; returns ``(x.grad,)``."""

    def step(i):
        x, loss = _forward(ext, i)
        loss.backward()
        return (x.grad,)

    return step


def _eager_grad(ext, i):
    x, loss = _forward(ext, i)
    loss.backward()
    return x.grad




@pytest.mark.parametrize("kind", ENTRY_POINTS)
def test_entry_points_give_the_same_counts(ext, kind):
    with entry_point(kind) as backward:
        for i in range(STEPS):
            x, loss = _forward(ext, i)
            backward(loss)
            assert_grads_equal([x.grad], [_eager_grad(ext, i)])
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=frame_breaks(kind))


def test_a_compiler_fn_replaces_torch_compile(ext):
    """``enable(compiler_fn)``: the user's function compiles the CA graph, once for
    every value, as ``torch._dynamo.compiled_autograd._enable(compiler_fn)`` would
    call it for one."""
    graphs = []

    def compiler_fn(gm):
        graphs.append(gm)
        return torch.compile(gm, backend="aot_eager")

    for i in range(STEPS):
        x, loss = _forward(ext, i)
        with ca_dynsaved.enable(compiler_fn):
            loss.backward()
        assert_grads_equal([x.grad], [_eager_grad(ext, i)])
    assert len(graphs) == 1 and isinstance(graphs[0], torch.fx.GraphModule)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)


def test_config_path_never_compiles_the_plugin(ext):
    """Backward from a torch.compile'd frame runs with Dynamo's frame callback on:
    the plugin's own frames must not be compiled (a traced copy froze a saved int
    in the prototype: DESIGN-NOTES pitfall 1)."""
    with entry_point("config") as backward:
        for i in range(STEPS):
            x, loss = _forward(ext, i)
            backward(loss)
            assert_grads_equal([x.grad], [_eager_grad(ext, i)])
    (reason,) = torch._dynamo.utils.counters["graph_break"]
    assert "Tensor.backward()" in reason
    compiled_files = [m.co_filename for m in torch._dynamo.utils.get_compilation_metrics()]
    assert compiled_files and not [f for f in compiled_files if f and f.startswith(PKG_DIR)]


def test_config_flag_by_assignment(ext):
    """A script sets the flags by plain assignment, then compiles its step."""
    config = torch._dynamo.config
    config.compiled_autograd = True
    setattr(config, ca_dynsaved.CONFIG_FLAG, True)
    try:

        @torch.compile(backend="aot_eager")
        def backward_step(loss):
            loss.backward()

        for i in range(4):
            x, loss = _forward(ext, i)
            backward_step(loss)
            assert_grads_equal([x.grad], [_eager_grad(ext, i)])
    finally:
        config.compiled_autograd = False
        setattr(config, ca_dynsaved.CONFIG_FLAG, False)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=1)


def test_config_flag_off_is_stock(ext):
    with torch._dynamo.config.patch(compiled_autograd=True):

        @torch.compile(backend="aot_eager")
        def backward_step(loss):
            loss.backward()

        for i in range(STEPS):
            x, loss = _forward(ext, i)
            backward_step(loss)
            assert_grads_equal([x.grad], [_eager_grad(ext, i)])
    limit = torch._dynamo.config.recompile_limit
    assert counts() == Counts(captures=1, compiles=limit, graph_breaks=1)


def test_stock_behaviour_returns_after_the_context(ext):
    step = _step_fn(ext)
    limit = torch._dynamo.config.recompile_limit
    # opaque: the compiled code of an opaque graph is kept for a recapture (reuse.py)
    plugin = lambda: ca_dynsaved.enable(backend="aot_eager", cpp_policy="opaque")  # noqa: E731
    run_loop(step, plugin)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    # Stock again: the plugin's cached CA graph is dropped, stock recompiles per value.
    run_loop(step, stock_enable)
    assert counts() == Counts(captures=2, compiles=1 + limit, graph_breaks=0)
    # And back: the stock graph is dropped; the plugin captures again and reuses the
    # function it compiled for the same graph before (reuse.py).
    run_loop(step, plugin)
    assert counts() == Counts(captures=3, compiles=1 + limit, graph_breaks=0)
    assert torch._dynamo.utils.counters["ca_dynsaved"]["reuse_hits"] == 1


def test_state_restored_exactly_after_exit(ext):
    before = patched_state()
    ctx = ca_dynsaved.enable(backend="aot_eager")
    with ctx:
        with ctx:  # re-entry of one object
            with ca_dynsaved.enable(backend="aot_eager"):  # nesting
                _, loss = _forward(ext, 0)
                loss.backward()
    assert patched_state() == before
    with pytest.raises(ZeroDivisionError):
        with ca_dynsaved.enable(backend="aot_eager"):
            1 / 0
    assert patched_state() == before
    assert _install._modes == []


def test_decorator_reentry(ext):
    calls = []

    @ca_dynsaved.enable(backend="aot_eager")
    def train_step(i, depth):
        if depth:
            train_step(i, depth - 1)
        x, loss = _forward(ext, i)
        loss.backward()
        calls.append(i)
        return x.grad

    before = patched_state()
    for i in range(3):
        assert_grads_equal([train_step(i, 2)], [_eager_grad(ext, i)])
    assert patched_state() == before
    assert len(calls) == 9
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)


def test_stock_enable_inside_plugin_context_uses_the_plugin(ext):
    """A CA context opened inside a plugin context (e.g. by a compiled frame) inherits it."""
    with ca_dynsaved.enable(backend="aot_eager"):
        for i in range(4):
            x, loss = _forward(ext, i)
            with stock_enable():
                loss.backward()
            assert_grads_equal([x.grad], [_eager_grad(ext, i)])
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)


def test_plugin_inside_stock_context_then_stock_again(ext):
    def bwd(i):
        x, loss = _forward(ext, i)
        loss.backward()
        assert_grads_equal([x.grad], [_eager_grad(ext, i)])

    with stock_enable():
        bwd(0)
        with ca_dynsaved.enable(backend="aot_eager"):
            for i in range(1, 5):
                bwd(i)
        bwd(5)  # the stock graph is captured again: the plugin's is not reused
    assert counts().captures == 3
    assert [n.handling for n in ca_dynsaved.report().nodes] == ["traced-dynamic"]


def test_config_entry_is_a_real_config(ext):
    config = torch._dynamo.config
    assert getattr(config, ca_dynsaved.CONFIG_FLAG) is False
    with config.patch(**{ca_dynsaved.CONFIG_FLAG: True}):
        assert config.get_config_copy()[ca_dynsaved.CONFIG_FLAG] is True
        saved = config.save_config()
    assert pickle.loads(saved)[ca_dynsaved.CONFIG_FLAG] is True
    assert getattr(config, ca_dynsaved.CONFIG_FLAG) is False
    config.load_config(saved)
    assert getattr(config, ca_dynsaved.CONFIG_FLAG) is True
    setattr(config, ca_dynsaved.CONFIG_FLAG, False)
    assert config.get_config_copy()[ca_dynsaved.CONFIG_FLAG] is False
    # Compile-ignored: toggling it does not change Dynamo's config hash.
    h = config.get_hash()
    with config.patch(**{ca_dynsaved.CONFIG_FLAG: True}):
        assert config.get_hash() == h


def test_install_uninstall_symmetric_and_idempotent(ext):
    from torch._dynamo.resume_execution import ContinueExecutionCache

    config = torch._dynamo.config
    stock_generate = ContinueExecutionCache.__dict__["generate"].__func__.__wrapped_generate__
    ca_dynsaved.uninstall()
    ca_dynsaved.uninstall()
    try:
        assert ca._enable is capture.stock_enable
        assert not hasattr(config, ca_dynsaved.CONFIG_FLAG)
        assert ca_dynsaved.CONFIG_FLAG not in config.get_config_copy()
        assert ContinueExecutionCache.__dict__["generate"].__func__ is stock_generate
    finally:
        ca_dynsaved.install()
        ca_dynsaved.install()
    assert ContinueExecutionCache.__dict__["generate"].__func__.__wrapped_generate__ is stock_generate
    assert ca._enable is _install._enable_hook
    assert getattr(config, ca_dynsaved.CONFIG_FLAG) is False
    assert ca_dynsaved.CONFIG_FLAG in config.get_config_copy()


def test_every_patch_is_in_the_registry_that_install_and_uninstall_walk(ext):
    """``_install.PATCHES`` lists every change install() makes: after uninstall()
    none is in place, after install() all are, and each applies and removes
    idempotently on its own."""
    assert all(p.applied() for p in _install.PATCHES)
    ca_dynsaved.uninstall()
    try:
        assert [p.applied() for p in _install.PATCHES] == [False] * len(_install.PATCHES)
        for patch in _install.PATCHES:
            patch.apply()
            patch.apply()
            assert patch.applied(), patch.what
            patch.remove()
            patch.remove()
            assert not patch.applied(), patch.what
    finally:
        ca_dynsaved.install()
    assert all(p.applied() for p in _install.PATCHES)


def test_changing_plugin_options_recaptures(ext):
    """The cached CA graph belongs to the options it was captured with."""

    step = _step_fn(ext)
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager", exclude=["ScaleFn"]), steps=2)
    run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=2)
    # excluded: stock; then the plugin's default: traced with sentinels
    assert [n.handling for n in ca_dynsaved.report().nodes] == ["stock", "traced-dynamic"]
    assert counts().captures == 2


def test_enable_after_uninstall_still_works(ext):
    """uninstall() removes the config entries and the hook; an explicit enable()
    needs neither (the policy falls back to its default)."""
    ca_dynsaved.uninstall()
    try:
        run_loop(_step_fn(ext), lambda: ca_dynsaved.enable(backend="aot_eager"), steps=4)
    finally:
        ca_dynsaved.install()
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)


def test_enable_inside_ca_disable(ext):
    """``enable`` inside ``compiled_autograd._disable()`` turns the plugin on, as
    stock ``_enable`` does there; after it exits the backward is eager again, and
    Dynamo's config path (which respects ``_disable``) stays off."""
    step = _step_fn(ext)
    before = patched_state()
    with ca._disable():
        run_loop(step, lambda: ca_dynsaved.enable(backend="aot_eager"), steps=4)
        assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
        step(5)  # eager: no capture
        with torch._dynamo.config.patch(compiled_autograd=True, **{ca_dynsaved.CONFIG_FLAG: True}):
            x, loss = _forward(ext, 6)
            torch.compile(lambda loss: loss.backward(), backend="aot_eager")(loss)
            assert_grads_equal([x.grad], [_eager_grad(ext, 6)])
        assert counts().captures == 1
    assert patched_state() == before


def test_two_threads_each_running_backward(ext):
    """CA's compiler is process-global; the plugin's contexts of two threads run
    one after the other, so each backward is compiled and right, and nothing is
    left installed (stock CA's contexts interleave and fail with "Nested Compiled
    Autograd Contexts must return before their parent context")."""
    step = _step_fn(ext)
    steps = 6
    want = {(t, i): step(i + t) for t in range(2) for i in range(steps)}
    got: dict[tuple[int, int], tuple[torch.Tensor]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)
    before = patched_state()

    def worker(t: int) -> None:
        try:
            for i in range(steps):
                barrier.wait()  # enter the contexts together
                with ca_dynsaved.enable(backend="aot_eager"):
                    got[t, i] = step(i + t)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert errors == [] and not any(thread.is_alive() for thread in threads)
    for key, grads in want.items():
        assert_grads_equal(got[key], grads)
    assert counts() == Counts(captures=1, compiles=1, graph_breaks=0)
    assert patched_state() == before


def test_console_script_is_the_module_command(monkeypatch, capsys):
    """pyproject's ``ca-dynsaved`` script is ``python -m ca_dynsaved``'s command."""
    import importlib
    import sys
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    module, _, attr = project["scripts"]["ca-dynsaved"].partition(":")
    cli = getattr(importlib.import_module(module), attr)
    monkeypatch.setattr(sys, "argv", ["ca-dynsaved", "--help"])
    assert cli() == 0
    assert "ca-dynsaved demo" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["ca-dynsaved", "no-such-command"])
    assert cli() == 2


def test_the_version_is_written_once():
    """pyproject.toml writes no version: it reads the package's ``__version__``, which
    is the installed metadata's."""
    import importlib.metadata
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "ca_dynsaved.__version__"}
    assert importlib.metadata.version("ca_dynsaved") == ca_dynsaved.__version__
