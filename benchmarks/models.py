"""The benchmark models, each with a custom autograd function as its activation:

* ``MLP`` (matmul-bound): 4 hidden layers, width 512, batch 64, the activation after
  each hidden layer (4 nodes a backward);
* ``Elementwise`` (fusion-sensitive): 3 layers of ``act(x * w + b)`` on 1M elements
  (1024 x 1024, w and b per column), nothing but elementwise math, so what inductor
  fuses (or cannot, around an opaque node) decides the step time.

The activation is ``y = gain * x * sigmoid(beta * x)``, negated when ``flip``, with
``mode`` choosing sigmoid or tanh gating, in three variants:

* ``cpp``: a C++ function saving beta (double) and gain (int), changing every step,
  and flip (bool) and mode (str), constant;
* ``python``: a Python ``autograd.Function`` with ``ctx.beta`` / ``ctx.gain``;
* ``hashed``: the C++ function with flip (bool) and mode (str) cycling through 4
  combinations, beta and gain fixed;
* ``cpp_sym`` (elementwise model only): a C++ function reading beta and gain with
  ``toSymFloat()`` / ``toSymInt()``;
* ``cpp_direct`` (elementwise model only): the same read with ``toDouble()`` /
  ``toInt()`` and used only as op arguments, opted in with ``trace_cpp``.
* ``cpp_derived`` (elementwise model only): a ``toDouble()`` / ``toInt()`` reader
  that computes a value from beta before use (``0.5 * beta``), not opted in.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch
from ca_dynsaved.demo import load_cpp

# One build per torch release: load_inline reuses a build by source hash alone.
BUILD_DIR = Path(__file__).resolve().parent.parent / ".ext_build" / f"torch-{torch.__version__}" / "bench"
WIDTH, DEPTH, BATCH = 512, 4, 64
VARIANTS = ("cpp", "python", "hashed")
ROWS, COLS, LAYERS = 1024, 1024, 3
ELEMENTWISE_VARIANTS = ("cpp", "cpp_sym", "cpp_direct", "cpp_derived", "python")
#: What enable(trace_cpp=...) names for the cpp_direct variant.
TRACE_CPP = ("DirectSchedAct",)

CPP_SOURCE = r"""
using namespace torch::autograd;

struct SchedAct : public Function<SchedAct> {
  static constexpr bool is_traceable = true;
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, double beta, int64_t gain,
                            bool flip, std::string mode) {
    ctx->saved_data["beta"] = beta;
    ctx->saved_data["gain"] = gain;
    ctx->saved_data["flip"] = flip;
    ctx->saved_data["mode"] = mode;
    ctx->save_for_backward({x});
    auto gate = mode == "tanh" ? 0.5 * (at::tanh(x * beta) + 1) : at::sigmoid(x * beta);
    return x * gate * static_cast<double>(flip ? -gain : gain);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    double beta = ctx->saved_data["beta"].toDouble();
    int64_t gain = ctx->saved_data["gain"].toInt();
    bool flip = ctx->saved_data["flip"].toBool();
    const std::string& mode = ctx->saved_data["mode"].toStringRef();
    auto x = ctx->get_saved_variables()[0];
    at::Tensor gate, dgate;
    if (mode == "tanh") {
      auto t = at::tanh(x * beta);
      gate = 0.5 * (t + 1);
      dgate = 0.5 * beta * (1 - t * t);
    } else {
      gate = at::sigmoid(x * beta);
      dgate = beta * gate * (1 - gate);
    }
    auto dx = (gate + x * dgate) * static_cast<double>(flip ? -gain : gain);
    return {grad[0] * dx, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor sched_act(at::Tensor x, double beta, int64_t gain, bool flip, std::string mode) {
  return SchedAct::apply(x, beta, gain, flip, mode);
}

// The sigmoid activation's forward, shared by the two functions below, which
// differ in how their backward reads beta and gain.
template <typename Derived>
struct SigmoidGate : public Function<Derived> {
  static constexpr bool is_traceable = true;
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, double beta, int64_t gain) {
    ctx->saved_data["beta"] = beta;
    ctx->saved_data["gain"] = gain;
    ctx->save_for_backward({x});
    return x * at::sigmoid(x * beta) * static_cast<double>(gain);
  }
};

// Reads beta and gain with toSymFloat() / toSymInt(), as upstream asks of C++
// functions: the plugin traces it.
struct SymSchedAct : public SigmoidGate<SymSchedAct> {
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    c10::SymFloat beta = ctx->saved_data["beta"].toSymFloat();
    c10::SymInt gain = ctx->saved_data["gain"].toSymInt();
    auto x = ctx->get_saved_variables()[0];
    auto gate = at::sigmoid(x.mul(c10::Scalar(beta)));
    auto dgate = gate.mul(c10::Scalar(beta)) * (1 - gate);
    auto dx = (gate + x * dgate).mul(c10::Scalar(gain));
    return {grad[0] * dx, at::Tensor(), at::Tensor()};
  }
};

at::Tensor sym_sched_act(at::Tensor x, double beta, int64_t gain) { return SymSchedAct::apply(x, beta, gain); }

// Reads them with plain toDouble() / toInt(), as most user code does, each number
// used only as an op argument: enable(trace_cpp=...) traces it.
struct DirectSchedAct : public SigmoidGate<DirectSchedAct> {
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    double beta = ctx->saved_data["beta"].toDouble();
    int64_t gain = ctx->saved_data["gain"].toInt();
    auto x = ctx->get_saved_variables()[0];
    auto gate = at::sigmoid(x * beta);
    auto dgate = gate * beta * (1 - gate);
    auto dx = (gate + x * dgate) * static_cast<double>(gain);
    return {grad[0] * dx, at::Tensor(), at::Tensor()};
  }
};

at::Tensor direct_sched_act(at::Tensor x, double beta, int64_t gain) { return DirectSchedAct::apply(x, beta, gain); }
// Computes a value from a saved number before using it (half of beta: sigmoid(z) =
// (tanh(z / 2) + 1) / 2), as `2 * alpha` or `1 - p` do: the plugin lifts the
// computed value from verify's run of each new beta (a derived value).
struct DerivedSchedAct : public SigmoidGate<DerivedSchedAct> {
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    double beta = ctx->saved_data["beta"].toDouble();
    int64_t gain = ctx->saved_data["gain"].toInt();
    double half = 0.5 * beta;
    auto x = ctx->get_saved_variables()[0];
    auto gate = (at::tanh(x * half) + 1) * 0.5;
    auto dgate = gate * beta * (1 - gate);
    auto dx = (gate + x * dgate) * static_cast<double>(gain);
    return {grad[0] * dx, at::Tensor(), at::Tensor()};
  }
};
at::Tensor derived_sched_act(at::Tensor x, double beta, int64_t gain) { return DerivedSchedAct::apply(x, beta, gain); }

// A nearly free backward with 4 lifted scalars, not traceable: under the plugin each
// node runs opaque, so a chain of them times what an opaque node costs. ALIAS: the
// backward returns its incoming gradient as is. TRACEABLE: the twin stock CA traces
// (and, with values that never change, fuses): what CA costs at best.
template <bool ALIAS, bool TRACEABLE = false>
struct TinyFn : public Function<TinyFn<ALIAS, TRACEABLE>> {
  static constexpr bool is_traceable = TRACEABLE;
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, int64_t a, int64_t b, double s, double t) {
    ctx->saved_data["a"] = a;
    ctx->saved_data["b"] = b;
    ctx->saved_data["s"] = s;
    ctx->saved_data["t"] = t;
    return x.clone();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    at::Tensor g = grad[0];
    if constexpr (!ALIAS) {
      auto k = ctx->saved_data["s"].toDouble() + ctx->saved_data["t"].toDouble()
               + static_cast<double>(ctx->saved_data["a"].toInt() - ctx->saved_data["b"].toInt());
      g = g * k;
    }
    return {g, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor tiny(at::Tensor x, int64_t a, int64_t b, double s, double t) { return TinyFn<false>::apply(x, a, b, s, t); }
at::Tensor tiny_alias(at::Tensor x, int64_t a, int64_t b, double s, double t) { return TinyFn<true>::apply(x, a, b, s, t); }
at::Tensor tiny_traceable(at::Tensor x, int64_t a, int64_t b, double s, double t) {
  return TinyFn<false, true>::apply(x, a, b, s, t);
}
at::Tensor tiny_alias_traceable(at::Tensor x, int64_t a, int64_t b, double s, double t) {
  return TinyFn<true, true>::apply(x, a, b, s, t);
}
"""


def build_extension() -> ModuleType:
    return load_cpp("ca_dynsaved_bench_ext", CPP_SOURCE, [
        "sched_act", "sym_sched_act", "direct_sched_act", "derived_sched_act", "tiny", "tiny_alias", "tiny_traceable",
        "tiny_alias_traceable",
    ], BUILD_DIR)


class PyAct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, beta, gain):
        ctx.beta, ctx.gain = beta, gain
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x * beta) * gain

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x * ctx.beta)
        return g * (s + x * ctx.beta * s * (1 - s)) * ctx.gain, None, None


def values(variant: str, step: int, varying: bool) -> tuple[float, int, bool, str]:
    """(beta, gain, flip, mode) of ``step``: fixed unless ``varying``."""
    if not varying:
        return 1.0, 1, False, "sigmoid"
    if variant == "hashed":
        return 1.0, 1, step % 2 == 1, ("sigmoid", "tanh")[step // 2 % 2]
    return 1.0 + 0.01 * step, 1 + step % 3, False, "sigmoid"


class MLP(torch.nn.Module):
    def __init__(self, variant: str, ext: ModuleType) -> None:
        super().__init__()
        self.variant, self.ext = variant, ext
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))
        self.head = torch.nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, beta: float, gain: int, flip: bool, mode: str) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            if self.variant == "python":
                x = PyAct.apply(x, beta, gain)
            else:
                x = self.ext.sched_act(x, beta, gain, flip, mode)
        return self.head(x).square().mean()


class Elementwise(torch.nn.Module):
    def __init__(self, variant: str, ext: ModuleType) -> None:
        super().__init__()
        self.variant, self.ext = variant, ext
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.rand(COLS) + 0.5) for _ in range(LAYERS))
        self.b = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(COLS) * 0.1) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor, beta: float, gain: int, flip: bool, mode: str) -> torch.Tensor:
        for w, b in zip(self.w, self.b):
            x = x * w + b
            if self.variant == "python":
                x = PyAct.apply(x, beta, gain)
            elif self.variant == "cpp_sym":
                x = self.ext.sym_sched_act(x, beta, gain)
            elif self.variant == "cpp_direct":
                x = self.ext.direct_sched_act(x, beta, gain)
            elif self.variant == "cpp_derived":
                x = self.ext.derived_sched_act(x, beta, gain)
            else:
                x = self.ext.sched_act(x, beta, gain, flip, mode)
        return x.square().mean()


class PyTiny(torch.autograd.Function):
    """A nearly free Python backward (run opaque with python_policy="opaque")."""

    @staticmethod
    def forward(ctx, x, a, s):
        ctx.a, ctx.s = a, s
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * (ctx.s + ctx.a), None, None


#: Chain variants of the opaque-node benchmark.
CHAIN_VARIANTS = ("cpp", "cpp_alias", "python")
CHAIN_NODES, CHAIN_ELEMENTS = 20, 16


def chain_loss(variant: str, ext: ModuleType, x: torch.Tensor, step: int, varying: bool, traceable: bool = False) -> torch.Tensor:
    """``CHAIN_NODES`` nearly free custom nodes in a row on ``CHAIN_ELEMENTS`` elements,
    their 4 (C++) or 2 (Python) saved numbers new at every step when ``varying``;
    ``traceable``: the C++ twin stock CA traces (a Python function it always does)."""
    # New values at every step (cycling after 997), each node's factor close to 1 so
    # that 20 of them in a row stay finite: C++ s + t + (a - b), Python s + a.
    k = step % 997 if varying else 1
    u = 1e-4 * k
    fn = {"cpp": ext.tiny, "cpp_alias": ext.tiny_alias}.get(variant)
    if traceable:
        fn = {"cpp": ext.tiny_traceable, "cpp_alias": ext.tiny_alias_traceable}.get(variant)
    for _ in range(CHAIN_NODES):
        if variant == "python":
            x = PyTiny.apply(x, k, 1.0 - k + u)
        else:
            x = fn(x, k, k, 0.5 + u, 0.5 - u / 2)
    return x.sum()
