"""A C++ backward that interprets a small program: value-driven data flow, generated.

``ProgramFn``'s backward runs the program held in its ``saved_data["prog"]`` (an int
list: CA hashes it, so each program is a capture of its own) on registers that start
as its saved tensors ``x``, ``y`` and incoming grads ``g0``, ``g1``; each instruction
appends one register, and the program's trailer picks the two returned gradients.
Every instruction lets the saved int ``k`` or double ``alpha`` decide something the way
user code does: which tensor an op takes, the order of its arguments, which result
goes where, which tensor an in-place op writes, an index, a dim, a chunk count, a
value turned into a tensor (through an op, or outside dispatch), a branch the
sentinels take alike. The programs and values come from hypothesis
(``tests/test_generated_programs.py``); each opcode's meaning is mirrored in
``OPCODES`` here, so a failing example reads as a program.

Also here: the explicit functions of docs/cpp.md's holes that are no programs (a
tag check without hashed values, which the symbolic probe takes for a symbolic
reader; a key whose saved type changes between steps; ``mark_non_differentiable`` /
``mark_dirty``, which stock CA asserts on while collecting the graph).
"""

from __future__ import annotations

from typing import Any

#: Big enough that both sentinels (7919 and -104728) are below it: a branch on
#: ``k > BIG`` is taken alike by both sentinel traces, so only verify can see it.
BIG = 1_000_000

#: opcode -> what the instruction computes into the new register (A, B: its two
#: operand registers; r: all registers so far; g0, g1: the incoming grads).
OPCODES = {
    0: "k > 0 ? A : B",
    1: f"k > {BIG} ? A : B",
    2: "k % 2 == 0 ? A : B",
    3: "r[mod(k, len(r))]",
    4: "k > 0 ? A - B : B - A",
    5: f"k > {BIG} ? B - A : A - B",
    6: "A * alpha",
    7: "A * double(k)",
    8: "A * (alpha + 1.0)  (a value computed from alpha)",
    9: "A + B",
    10: "A * B",
    11: "A.roll(k, 1)",
    12: "A * A.narrow(1, mod(k, 2), 1)",
    13: "A * A.index_select(1, full({1}, mod(k, 2)))",
    14: "A * A.gather(1, full({2, 1}, mod(k, 2)))",
    15: "A * A.select(1, mod(k, 2)).unsqueeze(1)",
    16: "A * A.sum(mod(k, 2), keepdim)  (a saved int as a dim)",
    17: "cat(reversed(A.chunk(1 + mod(k, 2), 0)))  (a saved int as a chunk count)",
    18: "A * from_blob(&alpha).clone()  (a value turned into a tensor outside dispatch)",
    19: "A * scalar_tensor(alpha)",
    20: "A * full({1}, alpha)",
    21: "A * (ones({1}) * alpha)",
    22: "A * torch::tensor({alpha})",
    23: f"k > {BIG} ? A.clamp(-100, 100) : A  (equal on small inputs)",
    24: "A * (k % 7 == 3 ? 2.0 : 3.0)",
    25: "alpha > 10 ? A * alpha : A * 2.0",
    26: f"v = A.clone(); if k > {BIG}: v.narrow(1, 0, 1).mul_(2); v  (an in-place write to a view)",
    27: f"v = A.clone(); u = B.clone(); (k > {BIG} ? v : u).add_(1); v  (which tensor an in-place op writes)",
    28: "A * double(min(k, 1000))",
    29: "A * g[k & 1]  (which incoming grad)",
    30: "A * saved[k & 1]  (which saved tensor)",
}
#: The trailer's modes: how the two returned gradients (gx, gy) are picked.
TRAILERS = {
    0: "gx, gy = r[a], r[b]",
    1: "swapped when k > 0",
    2: f"swapped when k > {BIG}",
    3: "gy undefined when k % 5 == 0",
}
#: The program's first entry: how the backward reads k and alpha.
READS = {0: "toInt() / toDouble()", 1: "a tag check (isInt() ? toInt() : 1000) that does not know SymInt"}


def program(read: int, instructions: list[tuple[int, int, int]], out_a: int, out_b: int, trailer: int) -> list[int]:
    """The int list ``ProgramFn`` saves: the read mode, each (opcode, a, b), the trailer."""
    return [read, *(v for ins in instructions for v in ins), out_a, out_b, trailer]


def describe(prog: list[int]) -> str:
    """A program as text, one instruction a line (registers: x, y, g0, g1, then r4...)."""
    read, body, (out_a, out_b, trailer) = prog[0], prog[1:-3], prog[-3:]
    lines = [f"read: {READS[read]}"]
    for i in range(0, len(body), 3):
        op, a, b = body[i : i + 3]
        lines.append(f"r{4 + i // 3} = {OPCODES[op]}  (A=r{a % (4 + i // 3)}, B=r{b % (4 + i // 3)})")
    n = 4 + len(body) // 3
    lines.append(f"return r{out_a % n}, r{out_b % n}: {TRAILERS[trailer]}")
    return "\n".join(lines)


SOURCE = r"""
namespace programs {
int64_t mod(int64_t a, int64_t m) { return ((a % m) + m) % m; }
constexpr int64_t BIG = 1000000;

// One instruction of tests/cpp_programs.py's OPCODES.
at::Tensor step(int64_t op, const at::Tensor& A, const at::Tensor& B, int64_t k, double alpha,
                const std::vector<at::Tensor>& r, const variable_list& g, const variable_list& saved) {
  switch (op) {
    case 0: return k > 0 ? A : B;
    case 1: return k > BIG ? A : B;
    case 2: return k % 2 == 0 ? A : B;
    case 3: return r[mod(k, static_cast<int64_t>(r.size()))];
    case 4: return k > 0 ? A - B : B - A;
    case 5: return k > BIG ? B - A : A - B;
    case 6: return A * alpha;
    case 7: return A * static_cast<double>(k);
    case 8: return A * (alpha + 1.0);
    case 9: return A + B;
    case 10: return A * B;
    case 11: return A.roll(k, 1);
    case 12: return A * A.narrow(1, mod(k, 2), 1);
    case 13: return A * A.index_select(1, at::full({1}, mod(k, 2), A.options().dtype(at::kLong)));
    case 14: return A * A.gather(1, at::full({2, 1}, mod(k, 2), A.options().dtype(at::kLong)));
    case 15: return A * A.select(1, mod(k, 2)).unsqueeze(1);
    case 16: return A * A.sum(mod(k, 2), true);
    case 17: {
      auto chunks = A.chunk(1 + mod(k, 2), 0);
      std::reverse(chunks.begin(), chunks.end());
      return at::cat(chunks, 0);
    }
    case 18: {
      double value = alpha;
      return A * at::from_blob(&value, {1}, at::TensorOptions().dtype(at::kDouble)).clone().to(A.scalar_type());
    }
    case 19: return A * at::scalar_tensor(alpha, A.options());
    case 20: return A * at::full({1}, alpha, A.options());
    case 21: return A * (at::ones({1}, A.options()) * alpha);
    case 22: return A * torch::tensor({alpha}, A.options());
    case 23: return k > BIG ? A.clamp(-100.0, 100.0) : A;
    case 24: return A * (k % 7 == 3 ? 2.0 : 3.0);
    case 25: return alpha > 10.0 ? A * alpha : A * 2.0;
    case 26: {
      auto v = A.clone();
      if (k > BIG) v.narrow(1, 0, 1).mul_(2.0);
      return v;
    }
    case 27: {
      auto v = A.clone(), u = B.clone();
      (k > BIG ? v : u).add_(1.0);
      return v;
    }
    case 28: return A * static_cast<double>(std::min<int64_t>(k, 1000));
    case 29: return A * g[k & 1];
    default: return A * saved[k & 1];
  }
}
}  // namespace programs

struct ProgramFn : public Function<ProgramFn> {
  static constexpr bool is_traceable = true;
  static variable_list forward(AutogradContext* ctx, at::Tensor x, at::Tensor y, std::vector<int64_t> prog,
                               int64_t k, double alpha) {
    ctx->saved_data["prog"] = prog;
    ctx->saved_data["k"] = k;
    ctx->saved_data["alpha"] = alpha;
    ctx->save_for_backward({x, y});
    return {x * y, x + y};
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto prog = ctx->saved_data["prog"].toIntVector();
    const auto& kv = ctx->saved_data["k"];
    const auto& av = ctx->saved_data["alpha"];
    int64_t k;
    double alpha;
    if (prog[0] == 1) {  // a tag check: under symbols neither branch reads the value
      k = kv.isInt() ? kv.toInt() : 1000;
      alpha = av.isDouble() ? av.toDouble() : 0.5;
    } else {
      k = kv.toInt();
      alpha = av.toDouble();
    }
    auto saved = ctx->get_saved_variables();
    std::vector<at::Tensor> r = {saved[0], saved[1], g[0], g[1]};
    size_t body = prog.size() - 4;
    for (size_t i = 1; i + 2 <= body; i += 3) {
      int64_t n = static_cast<int64_t>(r.size());
      at::Tensor a = r[programs::mod(prog[i + 1], n)], b = r[programs::mod(prog[i + 2], n)];
      r.push_back(programs::step(prog[i], a, b, k, alpha, r, g, saved));
    }
    int64_t n = static_cast<int64_t>(r.size()), end = static_cast<int64_t>(prog.size());
    at::Tensor gx = r[programs::mod(prog[end - 3], n)], gy = r[programs::mod(prog[end - 2], n)];
    int64_t trailer = prog[end - 1];
    if ((trailer == 1 && k > 0) || (trailer == 2 && k > programs::BIG)) std::swap(gx, gy);
    if (trailer == 3 && k % 5 == 0) gy = at::Tensor();
    return {gx, gy, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::vector<at::Tensor> program_fn(at::Tensor x, at::Tensor y, std::vector<int64_t> prog, int64_t k, double alpha) {
  return ProgramFn::apply(x, y, prog, k, alpha);
}

// Reads its saved numbers through a tag check that does not know SymInt / SymFloat:
// under the symbolic probe neither is read (no guard), so the probe calls it a
// symbolic reader, and a trace holds the fallback constants 1000 and 0.5.
struct TagCheckFn : public Function<TagCheckFn> {
  static constexpr bool is_traceable = true;
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, int64_t k, double alpha) {
    ctx->saved_data["k"] = k;
    ctx->saved_data["alpha"] = alpha;
    ctx->save_for_backward({x});
    return x * x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto& kv = ctx->saved_data["k"];
    const auto& av = ctx->saved_data["alpha"];
    int64_t k = kv.isInt() ? kv.toInt() : 1000;
    double alpha = av.isDouble() ? av.toDouble() : 0.5;
    auto x = ctx->get_saved_variables()[0];
    return {g[0] * x * static_cast<double>(k) + g[0] * alpha, at::Tensor(), at::Tensor()};
  }
};

at::Tensor tag_check_fn(at::Tensor x, int64_t k, double alpha) { return TagCheckFn::apply(x, k, alpha); }

// The same key saved as an int on some steps and as a double on others (CA's cache
// key does not hold the type: one graph for both); the backward reads either.
struct TypeSwitchFn : public Function<TypeSwitchFn> {
  static constexpr bool is_traceable = true;
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, double v, bool as_int) {
    if (as_int) {
      ctx->saved_data["v"] = static_cast<int64_t>(v);
    } else {
      ctx->saved_data["v"] = v;
    }
    ctx->save_for_backward({x});
    return x * x * v;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto& v = ctx->saved_data["v"];
    double d = v.isInt() ? static_cast<double>(v.toInt()) : v.toDouble();
    auto x = ctx->get_saved_variables()[0];
    return {g[0] * x * (2.0 * d), at::Tensor(), at::Tensor()};
  }
};

at::Tensor type_switch_fn(at::Tensor x, double v, bool as_int) { return TypeSwitchFn::apply(x, v, as_int); }

// A row-wise max as torch_scatter's scatter_max returns it: the values and the
// argmax, the argmax marked non-differentiable (DIRTY: the input's copy written in
// place and marked dirty instead). Stock CA asserts on either while it collects the
// graph (CppNode::compiled_args), before any node runs.
template <bool DIRTY>
struct RowMaxFn : public Function<RowMaxFn<DIRTY>> {
  static constexpr bool is_traceable = true;
  static variable_list forward(AutogradContext* ctx, at::Tensor x, double scale) {
    auto found = x.max(1);
    auto values = std::get<0>(found), index = std::get<1>(found);
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["cols"] = x.size(1);
    ctx->save_for_backward({index});
    if constexpr (DIRTY) {
      x.mul_(scale);
      ctx->mark_dirty({x});
      return {x, values};
    } else {
      ctx->mark_non_differentiable({index});
      return {values * scale, index};
    }
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto index = ctx->get_saved_variables()[0];
    double scale = ctx->saved_data["scale"].toDouble();
    int64_t cols = ctx->saved_data["cols"].toInt();
    if constexpr (DIRTY) {
      auto gx = g[0] * scale;
      if (g[1].defined()) gx = gx.scatter_add(1, index.unsqueeze(1), g[1].unsqueeze(1));
      return {gx, at::Tensor()};
    } else {
      auto gx = at::zeros({g[0].size(0), cols}, g[0].options());
      return {gx.scatter(1, index.unsqueeze(1), (g[0] * scale).unsqueeze(1)), at::Tensor()};
    }
  }
};

std::vector<at::Tensor> row_max(at::Tensor x, double scale) { return RowMaxFn<false>::apply(x, scale); }
std::vector<at::Tensor> row_max_dirty(at::Tensor x, double scale) { return RowMaxFn<true>::apply(x, scale); }
"""

FUNCTIONS = ["program_fn", "tag_check_fn", "type_switch_fn", "row_max", "row_max_dirty"]


def run(ext: Any, prog: list[int], k: int, alpha: float) -> tuple[Any, Any]:
    """One step: fresh leaves x, y (2 x 2, distinct values), both outputs in the loss;
    returns (x.grad, y.grad)."""
    import torch

    x = torch.tensor([[0.5, -1.25], [2.0, 0.75]], requires_grad=True)
    y = torch.tensor([[-0.5, 1.5], [0.25, -2.0]], requires_grad=True)
    a, b = ext.program_fn(x * 1.0, y * 1.0, prog, k, alpha)
    (a * torch.tensor([[1.0, 2.0], [3.0, 4.0]]) + b * torch.tensor([[-1.0, 0.5], [0.25, 2.0]])).sum().backward()
    return x.grad, y.grad
