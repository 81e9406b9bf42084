"""The dominance matrix's parts: the kinds of custom function, the value schedules and
the two models (``test_dominance.py`` measures each cell, stock against the plugin).

Every kind computes the same activation, ``y = gain * x * gate(beta * x)``, the gate a
sigmoid, or ``(tanh + 1) / 2`` where the mode starts with "tanh", negated where flip
is set; what differs is what it saves for its backward and how the backward reads it:

======================  ============================================================
``cpp_int_double``      C++, beta / gain read with ``toDouble()`` / ``toInt()``
``cpp_sym``             C++, read with ``toSymFloat()`` / ``toSymInt()``
``cpp_hashed``          C++, only flip (bool) and mode (str)
``cpp_numbers_hashed``  C++, beta, gain, flip and mode
``cpp_derived``         C++, ``toDouble()`` reader computing ``0.5 * beta`` first
``cpp_nontraceable``    C++, ``toDouble()`` / ``toInt()``, not ``is_traceable``
``py_numbers``          Python, ``ctx.beta`` / ``ctx.gain``
``py_hashed``           Python, only ``ctx.flip`` / ``ctx.mode``
``py_numbers_hashed``   Python, all four
``py_untraceable``      Python, numbers, a backward Dynamo cannot trace (a lookup
                        through ``bisect``, a C builtin Dynamo has no rule for)
======================  ============================================================
"""

from __future__ import annotations

import bisect
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
from ca_dynsaved.demo import load_cpp

BUILD_DIR = Path(__file__).resolve().parent.parent / ".ext_build" / f"torch-{torch.__version__}" / "dominance"

KINDS = (
    "cpp_int_double", "cpp_sym", "cpp_hashed", "cpp_numbers_hashed", "cpp_derived", "cpp_nontraceable",
    "py_numbers", "py_hashed", "py_numbers_hashed", "py_untraceable",
)
SCHEDULES = ("constant", "cycle", "new")
MODELS = ("elementwise", "mlp")
#: elementwise: 3 layers of act(x * w + b) on ROWS x COLS; mlp: DEPTH Linear(WIDTH) layers, batch BATCH
ROWS, COLS, LAYERS = 512, 1024, 3
WIDTH, DEPTH, BATCH = 512, 4, 64

CPP_SOURCE = r"""
using namespace torch::autograd;

static bool is_tanh(const std::string& mode) { return mode.rfind("tanh", 0) == 0; }

static at::Tensor act(const at::Tensor& x, double beta, double gain, bool tanh_) {
  auto gate = tanh_ ? (at::tanh(x * beta) + 1) * 0.5 : at::sigmoid(x * beta);
  return x * gate * gain;
}

// d act / dx, its numbers passed to ATen ops only (the sentinel trace's condition).
static at::Tensor act_grad(const at::Tensor& x, const at::Tensor& g, double beta, double gain, bool tanh_) {
  at::Tensor gate, dgate;
  if (tanh_) {
    auto t = at::tanh(x * beta);
    gate = (t + 1) * 0.5;
    dgate = (1 - t * t) * beta * 0.5;
  } else {
    gate = at::sigmoid(x * beta);
    dgate = gate * beta * (1 - gate);
  }
  return g * (gate + x * dgate) * gain;
}

// The forward of the functions that save beta and gain only; they differ in their backward.
template <typename Derived, bool TRACEABLE = true>
struct NumbersForward : public Function<Derived> {
  static constexpr bool is_traceable = TRACEABLE;
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, double beta, int64_t gain) {
    ctx->saved_data["beta"] = beta;
    ctx->saved_data["gain"] = gain;
    ctx->save_for_backward({x});
    return act(x, beta, static_cast<double>(gain), false);
  }
};

template <bool TRACEABLE>
struct NumbersAct : public NumbersForward<NumbersAct<TRACEABLE>, TRACEABLE> {
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    double beta = ctx->saved_data["beta"].toDouble();
    int64_t gain = ctx->saved_data["gain"].toInt();
    auto x = ctx->get_saved_variables()[0];
    return {act_grad(x, grad[0], beta, static_cast<double>(gain), false), at::Tensor(), at::Tensor()};
  }
};

struct SymAct : public NumbersForward<SymAct> {
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    c10::SymFloat beta = ctx->saved_data["beta"].toSymFloat();
    c10::SymInt gain = ctx->saved_data["gain"].toSymInt();
    auto x = ctx->get_saved_variables()[0];
    auto gate = at::sigmoid(x.mul(c10::Scalar(beta)));
    auto dgate = gate.mul(c10::Scalar(beta)) * (1 - gate);
    return {(grad[0] * (gate + x * dgate)).mul(c10::Scalar(gain)), at::Tensor(), at::Tensor()};
  }
};

struct HashedAct : public Function<HashedAct> {
  static constexpr bool is_traceable = true;
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, bool flip, std::string mode) {
    ctx->saved_data["flip"] = flip;
    ctx->saved_data["mode"] = mode;
    ctx->save_for_backward({x});
    return act(x, 1.0, flip ? -1.0 : 1.0, is_tanh(mode));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    bool flip = ctx->saved_data["flip"].toBool();
    bool tanh_ = is_tanh(ctx->saved_data["mode"].toStringRef());
    auto x = ctx->get_saved_variables()[0];
    return {act_grad(x, grad[0], 1.0, flip ? -1.0 : 1.0, tanh_), at::Tensor(), at::Tensor()};
  }
};

struct NumbersHashedAct : public Function<NumbersHashedAct> {
  static constexpr bool is_traceable = true;
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, double beta, int64_t gain, bool flip, std::string mode) {
    ctx->saved_data["beta"] = beta;
    ctx->saved_data["gain"] = gain;
    ctx->saved_data["flip"] = flip;
    ctx->saved_data["mode"] = mode;
    ctx->save_for_backward({x});
    return act(x, beta, static_cast<double>(flip ? -gain : gain), is_tanh(mode));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    double beta = ctx->saved_data["beta"].toDouble();
    int64_t gain = ctx->saved_data["gain"].toInt();
    bool flip = ctx->saved_data["flip"].toBool();
    bool tanh_ = is_tanh(ctx->saved_data["mode"].toStringRef());
    auto x = ctx->get_saved_variables()[0];
    return {act_grad(x, grad[0], beta, static_cast<double>(flip ? -gain : gain), tanh_),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Computes half of beta before use (sigmoid(z) = (tanh(z / 2) + 1) / 2).
struct DerivedAct : public NumbersForward<DerivedAct> {
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    double beta = ctx->saved_data["beta"].toDouble();
    int64_t gain = ctx->saved_data["gain"].toInt();
    double half = 0.5 * beta;
    auto x = ctx->get_saved_variables()[0];
    auto gate = (at::tanh(x * half) + 1) * 0.5;
    auto dgate = gate * beta * (1 - gate);
    return {grad[0] * (gate + x * dgate) * static_cast<double>(gain), at::Tensor(), at::Tensor()};
  }
};

at::Tensor int_double_act(at::Tensor x, double beta, int64_t gain) { return NumbersAct<true>::apply(x, beta, gain); }
at::Tensor nontraceable_act(at::Tensor x, double beta, int64_t gain) { return NumbersAct<false>::apply(x, beta, gain); }
at::Tensor sym_act(at::Tensor x, double beta, int64_t gain) { return SymAct::apply(x, beta, gain); }
at::Tensor hashed_act(at::Tensor x, bool flip, std::string mode) { return HashedAct::apply(x, flip, mode); }
at::Tensor numbers_hashed_act(at::Tensor x, double beta, int64_t gain, bool flip, std::string mode) {
  return NumbersHashedAct::apply(x, beta, gain, flip, mode);
}
at::Tensor derived_act(at::Tensor x, double beta, int64_t gain) { return DerivedAct::apply(x, beta, gain); }
"""


def build_extension() -> ModuleType:
    return load_cpp("ca_dynsaved_dominance_ext", CPP_SOURCE, [
        "int_double_act", "nontraceable_act", "sym_act", "hashed_act", "numbers_hashed_act", "derived_act",
    ], BUILD_DIR)


def _gate(x: torch.Tensor, beta: float, tanh_: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, d gate / d (beta x) times beta) of the activation."""
    if tanh_:
        t = torch.tanh(x * beta)
        return (t + 1) * 0.5, (1 - t * t) * beta * 0.5
    gate = torch.sigmoid(x * beta)
    return gate, gate * beta * (1 - gate)


class PyNumbers(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, beta, gain):
        ctx.beta, ctx.gain = beta, gain
        ctx.save_for_backward(x)
        return x * _gate(x, beta, False)[0] * gain

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        gate, dgate = _gate(x, ctx.beta, False)
        return g * (gate + x * dgate) * ctx.gain, None, None


class PyHashed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, flip, mode):
        ctx.flip, ctx.mode = flip, mode
        ctx.save_for_backward(x)
        return x * _gate(x, 1.0, mode.startswith("tanh"))[0] * (-1.0 if flip else 1.0)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        gate, dgate = _gate(x, 1.0, ctx.mode.startswith("tanh"))
        return g * (gate + x * dgate) * (-1.0 if ctx.flip else 1.0), None, None


class PyNumbersHashed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, beta, gain, flip, mode):
        ctx.beta, ctx.gain, ctx.flip, ctx.mode = beta, gain, flip, mode
        ctx.save_for_backward(x)
        return x * _gate(x, beta, mode.startswith("tanh"))[0] * (-gain if flip else gain)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        gate, dgate = _gate(x, ctx.beta, ctx.mode.startswith("tanh"))
        return g * (gate + x * dgate) * (-ctx.gain if ctx.flip else ctx.gain), None, None, None, None


_STEPS = [0.5, 1.5, 2.5, 3.5]


def _lookup(gain: int) -> float:
    """``gain`` through a table Dynamo cannot trace (``bisect``: a C builtin it has no
    rule for): the backward breaks the graph there."""
    return float(bisect.bisect_right(_STEPS, gain))


class PyUntraceable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, beta, gain):
        ctx.beta, ctx.gain = beta, gain
        ctx.save_for_backward(x)
        return x * _gate(x, beta, False)[0] * _lookup(gain)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        gate, dgate = _gate(x, ctx.beta, False)
        return g * (gate + x * dgate) * _lookup(ctx.gain), None, None


def values(schedule: str, step: int) -> tuple[float, int, bool, str]:
    """(beta, gain, flip, mode) at ``step``: the same every step (``constant``: not 1,
    which a graph specialised on it would fold away), 4 combinations in turn
    (``cycle``), or beta and the mode string new at every step (``new``: the mode
    keeps its gate, with the step in its name)."""
    if schedule == "constant":
        return 1.25, 2, False, "sigmoid"
    i = step % 4
    if schedule == "cycle":
        return 1.0 + 0.25 * i, 1 + i % 2, i % 2 == 1, ("sigmoid", "tanh")[i // 2]
    return 1.0 + 1e-3 * step, 1 + step % 3, i % 2 == 1, f"{('sigmoid', 'tanh')[i // 2]}-{step}"


def activation(kind: str, ext: ModuleType) -> Callable[[torch.Tensor, float, int, bool, str], torch.Tensor]:
    """``act(x, beta, gain, flip, mode)`` of ``kind``, each kind taking what it saves."""
    return {
        "cpp_int_double": lambda x, b, g, f, m: ext.int_double_act(x, b, g),
        "cpp_sym": lambda x, b, g, f, m: ext.sym_act(x, b, g),
        "cpp_hashed": lambda x, b, g, f, m: ext.hashed_act(x, f, m),
        "cpp_numbers_hashed": lambda x, b, g, f, m: ext.numbers_hashed_act(x, b, g, f, m),
        "cpp_derived": lambda x, b, g, f, m: ext.derived_act(x, b, g),
        "cpp_nontraceable": lambda x, b, g, f, m: ext.nontraceable_act(x, b, g),
        "py_numbers": lambda x, b, g, f, m: PyNumbers.apply(x, b, g),
        "py_hashed": lambda x, b, g, f, m: PyHashed.apply(x, f, m),
        "py_numbers_hashed": lambda x, b, g, f, m: PyNumbersHashed.apply(x, b, g, f, m),
        "py_untraceable": lambda x, b, g, f, m: PyUntraceable.apply(x, b, g),
    }[kind]


class Elementwise(torch.nn.Module):
    """Fusion-sensitive: nothing but elementwise math, 3 custom-function nodes."""

    def __init__(self, act: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.act = act
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.rand(COLS) + 0.5) for _ in range(LAYERS))
        self.b = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(COLS) * 0.1) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor, *values: Any) -> torch.Tensor:
        for w, b in zip(self.w, self.b):
            x = self.act(x * w + b, *values)
        return x.square().mean()


class MLP(torch.nn.Module):
    """Matmul-bound: DEPTH Linear layers, each followed by the activation."""

    def __init__(self, act: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.act = act
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))
        self.head = torch.nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, *values: Any) -> torch.Tensor:
        for layer in self.layers:
            x = self.act(layer(x), *values)
        return self.head(x).square().mean()


def model(name: str, kind: str, ext: ModuleType) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model and its input."""
    torch.manual_seed(0)
    act = activation(kind, ext)
    if name == "elementwise":
        return Elementwise(act), torch.randn(ROWS, COLS)
    return MLP(act), torch.randn(BATCH, WIDTH)
