"""Real C++ custom autograd functions for the tests, built once with load_inline.

Each function exists twice: ``is_traceable = true`` (Dynamo fake-runs the backward
under stock CA) and ``false`` (stock CA graph-breaks around it). The backward
reads its saved values with plain ``toInt()`` / ``toDouble()``, as user code does,
except ``SymScaleFn``'s, which reads them with ``toSymInt()`` / ``toSymFloat()``.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch
from ca_dynsaved.demo import load_cpp

import cpp_programs

# One build per torch release: load_inline reuses a build by source hash alone.
BUILD_DIR = Path(__file__).resolve().parent.parent / ".ext_build" / f"torch-{torch.__version__}"

CPP_SOURCE = r"""
using namespace torch::autograd;

// Saves 2 ints and 2 doubles in saved_data; every one changes the gradient.
template <bool TRACE>
struct ScaleFn : public Function<ScaleFn<TRACE>> {
  static constexpr bool is_traceable = TRACE;
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, int64_t a, int64_t b,
                            double s, double t) {
    ctx->saved_data["a"] = a;
    ctx->saved_data["b"] = b;
    ctx->saved_data["s"] = s;
    ctx->saved_data["t"] = t;
    ctx->save_for_backward({x});
    return x * static_cast<double>(a + b) * s + x * x * t;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_output) {
    int64_t a = ctx->saved_data["a"].toInt();
    int64_t b = ctx->saved_data["b"].toInt();
    double s = ctx->saved_data["s"].toDouble();
    double t = ctx->saved_data["t"].toDouble();
    auto x = ctx->get_saved_variables()[0];
    auto g = grad_output[0] * (static_cast<double>(a + b) * s + 2.0 * t * x)
             + static_cast<double>(a - b);
    return {g, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Three tensor inputs, two outputs, saved tensors. b's grad is computed only when
// needed; c's grad is never computed (an undefined grad by construction).
template <bool TRACE>
struct MultiFn : public Function<MultiFn<TRACE>> {
  static constexpr bool is_traceable = TRACE;
  static variable_list forward(AutogradContext* ctx, at::Tensor a, at::Tensor b,
                               at::Tensor c, int64_t k, double s) {
    ctx->saved_data["k"] = k;
    ctx->saved_data["s"] = s;
    ctx->save_for_backward({a, b});
    return {a * b * static_cast<double>(k), a * s + c};
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto k = static_cast<double>(ctx->saved_data["k"].toInt());
    auto s = ctx->saved_data["s"].toDouble();
    auto saved = ctx->get_saved_variables();
    auto a = saved[0], b = saved[1];
    at::Tensor ga = g[0] * b * k + g[1] * s;
    at::Tensor gb = ctx->needs_input_grad(1) ? at::Tensor(g[0] * a * k) : at::Tensor();
    return {ga, gb, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// x * k, saving k: the forward of the functions below, which differ in backward.
template <typename Derived>
struct TimesK : public Function<Derived> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, int64_t k) {
    ctx->saved_data["k"] = k;
    return x * static_cast<double>(k);
  }
};

// Returns no gradient when the saved int is odd: None depends on a saved value.
template <bool TRACE>
struct OddNoneFn : public TimesK<OddNoneFn<TRACE>> {
  static constexpr bool is_traceable = TRACE;
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto k = ctx->saved_data["k"].toInt();
    if (k % 2 == 1) return {at::Tensor(), at::Tensor()};
    return {g[0] * static_cast<double>(k), at::Tensor()};
  }
};

// Saves a bool, a string, an int vector and a dict of doubles (all hashed into
// CA's cache key, never lifted); each one changes the backward's math.
template <bool TRACE>
struct ConfigFn : public Function<ConfigFn<TRACE>> {
  static constexpr bool is_traceable = TRACE;
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, bool flip, std::string mode,
                            std::vector<int64_t> dims, double wa, double wb) {
    ctx->saved_data["flip"] = flip;
    ctx->saved_data["mode"] = mode;
    ctx->saved_data["dims"] = dims;
    c10::Dict<std::string, double> weights;
    weights.insert("a", wa);
    weights.insert("b", wb);
    ctx->saved_data["weights"] = weights;
    ctx->save_for_backward({x});
    return x * x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    bool flip = ctx->saved_data["flip"].toBool();
    const std::string& mode = ctx->saved_data["mode"].toStringRef();
    std::vector<int64_t> dims = ctx->saved_data["dims"].toIntVector();
    auto weights = ctx->saved_data["weights"].toGenericDict();
    double wa = weights.at("a").toDouble(), wb = weights.at("b").toDouble();
    auto x = ctx->get_saved_variables()[0];
    at::Tensor r = mode == "square" ? g[0] * x * 2.0 * wa : g[0] * wb;
    int64_t total = 0;
    for (auto d : dims) total += d;
    r = r * static_cast<double>(total + static_cast<int64_t>(dims.size()));
    if (flip) r = -r;
    return {r, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// A message-passing gather as GNN libraries write it: the source's sizes saved as
// an int list (CA hashes lists: each new batch size is a new capture), the index as
// a saved tensor, and a bool.
template <bool TRACE>
struct GatherFn : public Function<GatherFn<TRACE>> {
  static constexpr bool is_traceable = TRACE;
  static at::Tensor forward(AutogradContext* ctx, at::Tensor src, at::Tensor index, bool halve) {
    ctx->saved_data["src_shape"] = src.sizes().vec();
    ctx->saved_data["halve"] = halve;
    ctx->save_for_backward({index});
    auto out = src.index_select(0, index);
    return halve ? out * 0.5 : out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto shape = ctx->saved_data["src_shape"].toIntVector();
    auto index = ctx->get_saved_variables()[0];
    auto grad = ctx->saved_data["halve"].toBool() ? g[0] * 0.5 : g[0];
    auto src_grad = torch::zeros(shape, grad.options()).index_add_(0, index, grad);
    return {src_grad.narrow(0, 0, shape[0]), at::Tensor(), at::Tensor()};
  }
};

// One output per entry of a saved int vector: its length is graph structure.
template <bool TRACE>
struct SplitFn : public Function<SplitFn<TRACE>> {
  static constexpr bool is_traceable = TRACE;
  static variable_list forward(AutogradContext* ctx, at::Tensor x, std::vector<int64_t> chunks) {
    ctx->saved_data["chunks"] = chunks;
    variable_list outs;
    for (auto& part : x.split_with_sizes(chunks)) outs.push_back(part * 1.0);
    return outs;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto chunks = ctx->saved_data["chunks"].toIntVector();
    variable_list parts;
    for (size_t i = 0; i < g.size(); ++i) parts.push_back(g[i] * static_cast<double>(i + 1));
    return {at::cat(parts), at::Tensor()};
  }
};

// No gradient when the saved bool says so: None depends on a hashed value.
template <bool TRACE>
struct SkipFn : public Function<SkipFn<TRACE>> {
  static constexpr bool is_traceable = TRACE;
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, bool skip, int64_t k) {
    ctx->saved_data["skip"] = skip;
    ctx->saved_data["k"] = k;
    return x * static_cast<double>(k);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    if (ctx->saved_data["skip"].toBool()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    return {g[0] * static_cast<double>(ctx->saved_data["k"].toInt()), at::Tensor(), at::Tensor()};
  }
};

// Returns its incoming gradient as is while the saved int is >= 0, a new tensor
// (twice the gradient) when it is negative.
template <bool TRACE>
struct PassFn : public TimesK<PassFn<TRACE>> {
  static constexpr bool is_traceable = TRACE;
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    if (ctx->saved_data["k"].toInt() >= 0) return {g[0], at::Tensor()};
    return {g[0] * 2.0, at::Tensor()};
  }
};

// Raises from backward for some saved values (TORCH_CHECK_VALUE: a Python ValueError).
template <bool TRACE>
struct ThrowFn : public TimesK<ThrowFn<TRACE>> {
  static constexpr bool is_traceable = TRACE;
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto k = ctx->saved_data["k"].toInt();
    TORCH_CHECK_VALUE(k % 3 != 2, "ThrowFn backward refuses k=", k);
    return {g[0] * static_cast<double>(k), at::Tensor()};
  }
};

// Matmuls in backward: autocast changes their precision.
template <bool TRACE>
struct MatFn : public Function<MatFn<TRACE>> {
  static constexpr bool is_traceable = TRACE;
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, at::Tensor w, double s) {
    ctx->saved_data["s"] = s;
    ctx->save_for_backward({x, w});
    return x.mm(w) * s;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto s = ctx->saved_data["s"].toDouble();
    auto saved = ctx->get_saved_variables();
    auto gs = g[0] * s;
    return {gs.mm(saved[1].t()), saved[0].t().mm(gs), at::Tensor()};
  }
};

// Reads its saved values with toSymInt() / toSymFloat(), as upstream asks of C++
// functions: every use of them is visible to a tracer. MODE picks the backward:
// 0 tensor math, 1 a branch on the int, 2 the double into leaky_relu (an op whose
// Scalar argument no backend pass turns into a tensor).
template <bool TRACE, int MODE>
struct SymScaleFn : public Function<SymScaleFn<TRACE, MODE>> {
  static constexpr bool is_traceable = TRACE;
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, int64_t a, double s, bool flag) {
    ctx->saved_data["a"] = a;
    ctx->saved_data["s"] = s;
    if (flag) ctx->saved_data["flag"] = flag;  // only when asked: a hashed value
    ctx->save_for_backward({x});
    return x * x * s + x * static_cast<double>(a);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    c10::SymInt a = ctx->saved_data["a"].toSymInt();
    c10::SymFloat s = ctx->saved_data["s"].toSymFloat();
    auto x = ctx->get_saved_variables()[0];
    at::Tensor gx;
    if constexpr (MODE == 0) {
      gx = g[0] * x.mul(c10::Scalar(s)).mul(2.0) + g[0] * c10::Scalar(a);
    } else if constexpr (MODE == 1) {
      gx = a > 2 ? g[0] * x.mul(c10::Scalar(s)).mul(2.0) : g[0] * c10::Scalar(a);
    } else {
      gx = at::leaky_relu(g[0], c10::Scalar(s)) + g[0] * c10::Scalar(a);
    }
    if (ctx->saved_data.find("flag") != ctx->saved_data.end()) gx = -gx;
    return {gx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Reads its saved numbers with plain toInt() / toDouble(), as most user code does,
// and (MODE 0) uses them only as op arguments (alpha at two of them):
// enable(trace_cpp=...) may trace it.
// The other modes do what a sentinel check must refuse or verify must catch:
// 1 a transformed double, 2 k % 2, 3 caps (std::min) both sentinels pass under,
// 4 the double into leaky_relu (a Scalar-only op), 5 a branch on the double,
// 6 a tensor size read as a number (x.size(0)): traced, it would be baked in;
// 7 a size read only for large k (a branch verify's small tensors take the other
// way), 8 a read of the tensors' data (at::equal), 9 a value computed from alpha
// into leaky_relu. 1 and 2 compute values from the numbers: lifted (sentinel.Derived).
template <int MODE>
struct DirectFn : public Function<DirectFn<MODE>> {
  static constexpr bool is_traceable = true;
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, int64_t k, double alpha, double beta) {
    ctx->saved_data["k"] = k;
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["beta"] = beta;
    ctx->save_for_backward({x});
    return x * x * alpha + x * beta;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    int64_t k = ctx->saved_data["k"].toInt();
    double alpha = ctx->saved_data["alpha"].toDouble();
    double beta = ctx->saved_data["beta"].toDouble();
    auto x = ctx->get_saved_variables()[0];
    at::Tensor gx;
    if constexpr (MODE == 0) {
      // alpha at two ops: one lifted number, two uses in the traced graph
      gx = g[0] * x * alpha * static_cast<double>(k) + g[0] * beta + g[0] * alpha;
    } else if constexpr (MODE == 1) {
      gx = g[0] * x * (2.0 * alpha) + g[0] * beta;
    } else if constexpr (MODE == 2) {
      gx = g[0] * x * alpha * static_cast<double>(k % 2) + g[0] * beta;
    } else if constexpr (MODE == 3) {
      gx = g[0] * x * std::min(alpha, 10.0) * static_cast<double>(std::min<int64_t>(k, 1000000)) + g[0] * beta;
    } else if constexpr (MODE == 4) {
      gx = at::leaky_relu(g[0] * x, alpha) * static_cast<double>(k) + g[0] * beta;
    } else if constexpr (MODE == 5) {
      gx = alpha > 0.5 ? g[0] * x * alpha * static_cast<double>(k) : g[0] * beta;
    } else if constexpr (MODE == 6) {
      gx = g[0] * x * alpha * static_cast<double>(k) * static_cast<double>(x.size(0)) + g[0] * beta;
    } else if constexpr (MODE == 7) {
      // reads a size only for k above both sentinels; on verify's small tensors the
      // branch goes the template's way
      bool big = k > 1000000 && x.size(0) > 3;
      gx = g[0] * x * alpha * (big ? 2.0 : 1.0) + g[0] * beta;
    } else if constexpr (MODE == 9) {
      // a value computed from alpha, into an op whose Scalar no tensor can carry
      gx = at::leaky_relu(g[0] * x, 2.0 * alpha) * static_cast<double>(k) + g[0] * beta;
    } else {
      // reads the tensors' data
      gx = at::equal(x, g[0]) ? g[0] * beta : g[0] * x * alpha + g[0] * beta;
    }
    return {gx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// A mode (str, hashed) and alpha read with toDouble(), with a branch on alpha that
// both sentinels take the same way: a later mode's own graph must verify each alpha.
struct ModeFn : public Function<ModeFn> {
  static constexpr bool is_traceable = true;
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, std::string mode, double alpha) {
    ctx->saved_data["mode"] = mode;
    ctx->saved_data["alpha"] = alpha;
    ctx->save_for_backward({x});
    return x * x * alpha;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const std::string& mode = ctx->saved_data["mode"].toStringRef();
    double alpha = ctx->saved_data["alpha"].toDouble();
    auto x = ctx->get_saved_variables()[0];
    at::Tensor gx = alpha > 0.5 ? g[0] * x * alpha : g[0] * alpha;
    if (mode == "neg") gx = -gx;
    if (mode == "twice") gx = gx * 2.0;
    return {gx, at::Tensor(), at::Tensor()};
  }
};

at::Tensor mode_fn(at::Tensor x, std::string mode, double alpha) { return ModeFn::apply(x, mode, alpha); }

at::Tensor direct_fn(at::Tensor x, int64_t k, double alpha, double beta, int64_t mode) {
  switch (mode) {
    case 0: return DirectFn<0>::apply(x, k, alpha, beta);
    case 1: return DirectFn<1>::apply(x, k, alpha, beta);
    case 2: return DirectFn<2>::apply(x, k, alpha, beta);
    case 3: return DirectFn<3>::apply(x, k, alpha, beta);
    case 4: return DirectFn<4>::apply(x, k, alpha, beta);
    case 5: return DirectFn<5>::apply(x, k, alpha, beta);
    case 6: return DirectFn<6>::apply(x, k, alpha, beta);
    case 7: return DirectFn<7>::apply(x, k, alpha, beta);
    case 9: return DirectFn<9>::apply(x, k, alpha, beta);
    default: return DirectFn<8>::apply(x, k, alpha, beta);
  }
}

at::Tensor sym_scale_traceable(at::Tensor x, int64_t a, double s, bool flag) {
  return SymScaleFn<true, 0>::apply(x, a, s, flag);
}
at::Tensor sym_scale_opaque(at::Tensor x, int64_t a, double s, bool flag) {
  return SymScaleFn<false, 0>::apply(x, a, s, flag);
}
at::Tensor sym_branch_traceable(at::Tensor x, int64_t a, double s, bool flag) {
  return SymScaleFn<true, 1>::apply(x, a, s, flag);
}
at::Tensor sym_leaky_traceable(at::Tensor x, int64_t a, double s, bool flag) {
  return SymScaleFn<true, 2>::apply(x, a, s, flag);
}
at::Tensor pass_traceable(at::Tensor x, int64_t k) { return PassFn<true>::apply(x, k); }
at::Tensor pass_opaque(at::Tensor x, int64_t k) { return PassFn<false>::apply(x, k); }
at::Tensor throw_traceable(at::Tensor x, int64_t k) { return ThrowFn<true>::apply(x, k); }
at::Tensor throw_opaque(at::Tensor x, int64_t k) { return ThrowFn<false>::apply(x, k); }
at::Tensor mat_traceable(at::Tensor x, at::Tensor w, double s) { return MatFn<true>::apply(x, w, s); }
at::Tensor mat_opaque(at::Tensor x, at::Tensor w, double s) { return MatFn<false>::apply(x, w, s); }
at::Tensor gather_traceable(at::Tensor src, at::Tensor index, bool halve) {
  return GatherFn<true>::apply(src, index, halve);
}
at::Tensor gather_opaque(at::Tensor src, at::Tensor index, bool halve) {
  return GatherFn<false>::apply(src, index, halve);
}
at::Tensor skip_traceable(at::Tensor x, bool skip, int64_t k) { return SkipFn<true>::apply(x, skip, k); }
at::Tensor skip_opaque(at::Tensor x, bool skip, int64_t k) { return SkipFn<false>::apply(x, skip, k); }
at::Tensor config_traceable(at::Tensor x, bool flip, std::string mode, std::vector<int64_t> dims,
                            double wa, double wb) {
  return ConfigFn<true>::apply(x, flip, mode, dims, wa, wb);
}
at::Tensor config_opaque(at::Tensor x, bool flip, std::string mode, std::vector<int64_t> dims,
                         double wa, double wb) {
  return ConfigFn<false>::apply(x, flip, mode, dims, wa, wb);
}
std::vector<at::Tensor> split_traceable(at::Tensor x, std::vector<int64_t> chunks) {
  return SplitFn<true>::apply(x, chunks);
}
std::vector<at::Tensor> split_opaque(at::Tensor x, std::vector<int64_t> chunks) {
  return SplitFn<false>::apply(x, chunks);
}
at::Tensor scale_traceable(at::Tensor x, int64_t a, int64_t b, double s, double t) {
  return ScaleFn<true>::apply(x, a, b, s, t);
}
at::Tensor scale_opaque(at::Tensor x, int64_t a, int64_t b, double s, double t) {
  return ScaleFn<false>::apply(x, a, b, s, t);
}
std::vector<at::Tensor> multi_traceable(at::Tensor a, at::Tensor b, at::Tensor c,
                                        int64_t k, double s) {
  return MultiFn<true>::apply(a, b, c, k, s);
}
std::vector<at::Tensor> multi_opaque(at::Tensor a, at::Tensor b, at::Tensor c,
                                     int64_t k, double s) {
  return MultiFn<false>::apply(a, b, c, k, s);
}
at::Tensor odd_none_traceable(at::Tensor x, int64_t k) { return OddNoneFn<true>::apply(x, k); }
at::Tensor odd_none_opaque(at::Tensor x, int64_t k) { return OddNoneFn<false>::apply(x, k); }
"""

FUNCTIONS = [
    "scale_traceable",
    "scale_opaque",
    "multi_traceable",
    "multi_opaque",
    "odd_none_traceable",
    "odd_none_opaque",
    "config_traceable",
    "config_opaque",
    "split_traceable",
    "split_opaque",
    "skip_traceable",
    "skip_opaque",
    "throw_traceable",
    "throw_opaque",
    "mat_traceable",
    "mat_opaque",
    "sym_scale_traceable",
    "sym_scale_opaque",
    "sym_branch_traceable",
    "sym_leaky_traceable",
    "direct_fn",
    "mode_fn",
    "pass_traceable",
    "pass_opaque",
    "gather_traceable",
    "gather_opaque",
]


def load(verbose: bool = False) -> ModuleType:
    """Build (or reuse, when the source is unchanged) and import the extension, the
    program interpreter of ``cpp_programs`` included (one build)."""
    return load_cpp(
        "ca_dynsaved_test_ext", CPP_SOURCE + cpp_programs.SOURCE, FUNCTIONS + cpp_programs.FUNCTIONS,
        BUILD_DIR / "ca_dynsaved_test_ext", verbose,
    )
