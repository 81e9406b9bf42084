"""The benchmark tables and plot, from benchmarks/results/latest.json (which
``pytest benchmarks/ --benchmark-only`` writes): rewrites the generated blocks of
docs/benchmarks.md (every table) and README.md (the stock-vs-plugin summary) and, where
matplotlib is installed (``pip install -e '.[plot]'``), writes docs/benchmarks.png.

    python benchmarks/report.py [results.json]

tests/test_docs.py checks that the committed blocks are what this prints for the
committed results.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ca_dynsaved import _docblocks
from dominance import KINDS, SCHEDULES  # benchmarks/dominance.py: the matrix's rows, in order

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: The commands named in the markers of the blocks this writes (docs/benchmarks.md, README.md).
COMMAND = "python benchmarks/report.py"
SUMMARY_COMMAND = COMMAND + " (summary)"
REAL_MODEL_COMMAND = COMMAND + " (real model)"
#: What ``pytest benchmarks/test_real_model.py --benchmark-only`` writes.
REAL_MODEL_RESULTS = HERE / "results" / "real_model.json"
PLOT = ROOT / "docs" / "benchmarks.png"
#: The README's rows: (model, variant, what the model is, the custom function and how the plugin runs it).
SUMMARY = (
    ("mlp", "cpp", "MLP (matmul-bound)", "C++, `toDouble()` / `toInt()` reader, constant bool / str: traced with sentinels, verified"),
    ("mlp", "hashed", "MLP", "C++, bool / str cycling 4 combinations: the first traced, 3 opaque (uncompiled) until each gets its own traced graph at its 16th run"),
    ("mlp", "python", "MLP", "Python, ctx float and int: traced"),
    ("elementwise", "cpp", "elementwise (fusion-sensitive)", "C++, `toDouble()` reader, constant bool / str: traced with sentinels, verified"),
    ("elementwise", "cpp_sym", "elementwise", "C++, `toSymFloat()` reader: traced"),
    ("elementwise", "cpp_direct", "elementwise", "C++, `toDouble()` reader opted in (`trace_cpp`, verify on): traced"),
    ("elementwise", "cpp_derived", "elementwise", "C++, `toDouble()` reader computing `0.5 * beta`: traced, the value lifted from verify's run"),
    ("elementwise", "python", "elementwise", "Python, ctx float: traced"),
)


MODELS = {
    "mlp": "MLP 4x512, batch 64, 4 custom-function nodes (matmul-bound)",
    "elementwise": "elementwise, 3 layers of act(x * w + b) on 1024x1024, 3 custom-function nodes (fusion-sensitive)",
}
#: The order variants are shown in (tables and plot).
VARIANTS = ("cpp", "cpp_sym", "cpp_direct", "cpp_derived", "python", "hashed")
CONFIGS = ("eager", "stock_constant", "stock_varying", "plugin_varying", "plugin_opaque_varying", "plugin_trust_varying")


#: The run length the tables project to: the first steps as measured, then the steady step.
LONG_RUN = 2000


def measured(r: dict) -> tuple[int, float]:
    """(steps, seconds) measured from a fresh state: the first ``r['steps']``, or
    further where the harness measured a longer prefix (``harness.PREFIX``)."""
    return r.get("prefix_steps", r["steps"]), r.get("prefix_s", r["total_s"])


def long_run_s(r: dict) -> float:
    """Seconds to ``LONG_RUN`` steps: the measured first steps (compiles included),
    then the steady step for the rest."""
    steps, seconds = measured(r)
    return seconds + r["steady_us"] * 1e-6 * (LONG_RUN - steps)


def cost(us: float, unit: str = "") -> str:
    """A cost as the tables print it: a difference below zero (the config with more
    work measured faster) is this machine's noise, never printed as a negative cost."""
    return f"{us:.0f}{unit}" if us >= 0 else "within noise (< 0)"


def crossing(r: dict, other: dict) -> str:
    """Where ``r``'s cumulative time crosses ``other``'s (both linear after their
    measured first steps): who is ahead, and from which step on."""
    steps, seconds = measured(r)
    lead = measured(other)[1] - seconds  # > 0: r ahead after the first steps
    gain = (other["steady_us"] - r["steady_us"]) * 1e-6  # > 0: r gains each step
    if lead >= 0 and gain >= 0:
        return "ahead throughout"
    if lead <= 0 and gain <= 0:
        return "behind throughout"
    step = steps + lead / -gain
    return f"{'ahead' if lead < 0 else 'behind'} from step {step:,.0f}"


def table(data: dict) -> str:
    first = next(r for r in data["results"] if r.get("model") not in ("capture", "chain", "varying_batch"))
    lines = [
        f"Total: the first {first['steps']} steps from a fresh state, compiles included; steady: the smallest "
        f"of {first.get('passes', 3)} interleaved passes' median step (each pass runs every config of a variant "
        "in turn, one config later than the last pass, each from a fresh state warmed past its compiles), values still changing; backend "
        f"{first['backend']}; torch {data['torch']}; {data['machine']}; {data['date']}. "
        "Ratios are against stock compiled autograd in the same run, with values that "
        "never change (stock_constant, the floor) and that change every step (stock_varying). "
        f"{LONG_RUN:,} steps: the first steps as measured (100 for hashed, whose later combinations get their "
        "own graphs at steps 61-63; its steady passes warmed 100 steps), then the steady step; against stock_varying: "
        "whether the config's cumulative time is ahead of stock's (the same workload), and from which step.",
    ]
    for model, title in MODELS.items():
        rows = _rows(data, model)
        if not rows:
            continue
        variants = sorted({v for v, _ in rows}, key=VARIANTS.index)
        lines += [
            "",
            f"Model: {title}.",
            "",
            "| variant | config | compiles | captures | opaque nodes | total s | steady µs/step | "
            "total / stock_constant | total / stock_varying | steady / stock_constant | "
            f"steady / stock_varying | µs per opaque node | {LONG_RUN:,} steps s | {LONG_RUN:,} / stock_varying | "
            "against stock_varying |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for v in variants:
            floor, varying = rows.get((v, "stock_constant")), rows.get((v, "stock_varying"))
            for config in CONFIGS:
                r = rows.get((v, config))
                if r is None or floor is None or varying is None:
                    continue
                per_node = cost((r["steady_us"] - floor["steady_us"]) / r["opaque_nodes"]) if r["opaque_nodes"] else ""
                lines.append(
                    f"| {v} | {config} | {r['compiles']} | {r['captures']} | {r['opaque_nodes']} | "
                    f"{r['total_s']:.2f} | {r['steady_us']:.0f} | {r['total_s'] / floor['total_s']:.2f} | "
                    f"{r['total_s'] / varying['total_s']:.2f} | {r['steady_us'] / floor['steady_us']:.2f} | "
                    f"{r['steady_us'] / varying['steady_us']:.2f} | {per_node} | {long_run_s(r):.1f} | "
                    f"{long_run_s(r) / long_run_s(varying):.2f} | {'' if r is varying else crossing(r, varying)} |"
                )
    captures = [r for r in data["results"] if r.get("model") == "capture"]
    if captures:
        lines += [
            "",
            "Capture cost: one compiled-autograd capture of the elementwise model's backward "
            "(4x1024), stock against the plugin, which traces the C++ functions itself "
            "(cpp_sym automatically, cpp_direct opted in with verify on) or probes the Python "
            f"one; each from an empty CA cache, compiler = identity; min of {captures[0]['repeats']}.",
            "",
            "| variant | stock ms | plugin ms | plugin / stock | plugin's first capture ms |",
            "|---|---|---|---|---|",
        ]
        for r in captures:
            lines.append(
                f"| {r['variant']} | {r['stock_ms']:.1f} | {r['plugin_ms']:.1f} | "
                f"{r['plugin_ms'] / r['stock_ms']:.2f} | {r['plugin_first_ms']:.1f} |"
            )
    chains = [r for r in data["results"] if r.get("model") == "chain"]
    if chains:
        c = chains[0]
        lines += [
            "",
            f"Opaque nodes (test_opaque_overhead.py): whole training steps of a chain of {c['nodes']} custom "
            f"nodes with a nearly free backward ({c['elements']} elements; C++: 4 lifted scalars, not "
            "traceable; Python: run opaque with python_policy=\"opaque\"; cpp_alias returns its incoming "
            "gradient as is), values new at every step for the plugin; stock_constant: stock CA on the "
            "traceable twin with constant values (traced and fused: CA at its cheapest); the smallest of "
            "interleaved passes' medians. Per node: (config - eager) / nodes. Explaining it (not part of "
            "the figure): the plugin's time in the op outside the user's backward call, the runtime "
            "wrapper's share, one dispatch of an op with this signature, the user's backward call.",
            "",
            "| variant | eager µs/step | stock_constant µs/step | plugin µs/step | plugin - eager µs/node | "
            "stock_constant - eager µs/node | plugin / stock_constant | in op / wrapper / dispatch / backward call µs |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in chains:
            lines.append(
                f"| {r['variant']} | {r['eager_us']:.0f} | {r['stock_constant_us']:.0f} | {r['plugin_varying_us']:.0f} | "
                f"{r['per_node_vs_eager_us']:.1f} | {r['stock_constant_per_node_vs_eager_us']:.1f} | "
                f"{r['plugin_vs_stock_constant']:.2f} | {r['in_op_us']:.1f} / {r['wrapper_per_node_us']:.1f} / "
                f"{r['dispatch_us']:.1f} / {r['backward_call_us']:.1f} |"
            )
    for r in (r for r in data["results"] if r.get("model") == "varying_batch"):
        lines += [
            "",
            "Batches whose saved sizes change (test_varying_batch.py): a whole step of a 2-layer "
            "message-passing net (64 features, about 2,000 nodes and 16,000 edges a batch) whose C++ "
            "gathers save the source's sizes as an int list and an alternating bool; the batch size "
            f"changes every step except in stock_constant; backend {r['backend']}; the smallest of "
            f"{r['passes']} interleaved passes' median step. Counts after the warm-up "
            "(captures, graphs, breaks).",
            "",
            "| config | steady ms/step | × eager | counts |",
            "|---|---|---|---|",
        ]
        for config, ms in r["steady_ms"].items():
            counts = r["counts_at_warmup"].get(config, "")
            lines.append(f"| {config} | {ms:.2f} | {r['vs_eager'][config]:.2f} | {counts} |")
        lines.append(
            f"\nThe plugin's captures before its switch to plain autograd: {r['plugin_capture_step_ms']:.1f} ms "
            f"a step; its first tries under CA add {r['plugin_first_tries_ms_per_step']:.2f} ms a step, "
            "then half as much after each."
        )
    for r in (r for r in data["results"] if r.get("model") == "verify_cost"):
        lines += [
            "",
            "verify's cost (test_verify_cost.py): whole steps of the elementwise model, cpp_direct opted in, "
            f"values new at every step; the smallest of {r['passes']} interleaved passes' medians; "
            "× stock_constant (stock CA, values constant).",
            "",
            "| config | steady µs/step | × stock_constant |",
            "|---|---|---|",
        ]
        for config in ("stock_constant", "plugin_varying", "plugin_trust_varying"):
            lines.append(f"| {config} | {r[config + '_us']:.0f} | {r[config + '_vs_stock_constant']:.2f} |")
    for r in (r for r in data["results"] if r.get("model") == "verify_blocks"):
        lines += [
            "",
            f"The proof's cost at scale (test_verify_blocks.py): whole steps of a {r['blocks']}-block residual model "
            "(each block a Linear, a C++ `toDouble()` / `toInt()` reader traced by default and verified, a Python "
            f"function with a ctx float; the numbers per block), backend {r['backend']}; the smallest of "
            f"{r['passes']} passes' medians (spread: the largest over the smallest), the two plugin configs "
            "alternating in windows of 5 steps within each pass (one captured graph).",
            "",
            "| config | steady µs/step | spread |",
            "|---|---|---|",
        ]
        for config in ("eager", "stock_constant", "plugin_constant", "plugin_varying"):
            lines.append(f"| {config} | {r[config + '_us']:.0f} | {r[config + '_spread']:.2f} |")
        lines.append(
            f"\nplugin_varying ÷ plugin_constant: {r['varying_vs_constant']:.2f} (pass by pass: "
            f"{min(r['pass_ratios']):.2f}–{max(r['pass_ratios']):.2f}); the proof's cost per new tuple "
            f"inside whole steps: {cost(r['per_tuple_us'], ' µs')} ({r['blocks']} new tuples a step); one check alone, "
            f"cache-warm: {r['one_check_us']:.0f} µs."
        )
    direct = {r["config"]: r for r in data["results"] if r.get("variant") == "cpp_direct" and r.get("model") == "elementwise"}
    if "plugin_varying" in direct and "plugin_trust_varying" in direct:
        difference = direct["plugin_varying"]["steady_us"] - direct["plugin_trust_varying"]["steady_us"]
        lines += [
            "",
            f"verify's cost per new value (cpp_direct, 3 nodes, every step new): "
            f"{cost(difference, ' µs a step')} (plugin_varying - plugin_trust_varying, steady), one check: "
            "the 3 nodes share their function, layout and values, so they share its result.",
        ]
    return "\n".join(lines) + "\n"


def _rows(data: dict, model: str) -> dict[tuple[str, str], dict]:
    return {(r["variant"], r["config"]): r for r in data["results"] if r.get("model") == model and "config" in r}


def summary(data: dict) -> str:
    """The README's table: for each main case, compiles and graph breaks (stock → plugin,
    values new at every step) and the plugin's steady step against stock and eager."""
    lines = [
        f"Torch {data['torch']}, inductor, {data['machine']}, {data['date']}.",
        "",
        "| model | custom function: how the plugin runs it | compiles, stock → plugin | graph breaks, stock → plugin "
        "| plugin step ÷ stock, values changing | ÷ stock, values constant | ÷ eager "
        f"| {LONG_RUN:,} steps ÷ stock, values changing |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, variant, title, function in SUMMARY:
        rows = _rows(data, model)
        stock, plugin = rows[(variant, "stock_varying")], rows[(variant, "plugin_varying")]
        constant, eager = rows[(variant, "stock_constant")], rows[(variant, "eager")]
        lines.append(
            f"| {title} | {function} | {stock['compiles']} → {plugin['compiles']} | {stock['breaks']} → {plugin['breaks']} | "
            f"{plugin['steady_us'] / stock['steady_us']:.2f} | {plugin['steady_us'] / constant['steady_us']:.2f} | "
            f"{plugin['steady_us'] / eager['steady_us']:.2f} | {long_run_s(plugin) / long_run_s(stock):.2f} |"
        )
    for r in (r for r in data["results"] if r.get("model") == "varying_batch"):
        per_step = [n / r["warmup_steps"]["stock_varying"] for n in r["counts_at_warmup"]["stock_varying"]]
        plugin = r["counts_at_warmup"]["plugin_varying"]
        ms = r["steady_ms"]
        lines.append(
            f"| message passing, batch size new every step | C++ gathers saving sizes as an int list: "
            f"{plugin[0]} captures, then plain autograd | {per_step[1]:g} a step → {plugin[1]} | "
            f"{per_step[2]:g} a step → {plugin[2]} | {ms['plugin_varying'] / ms['stock_varying']:.3f} | "
            f"{ms['plugin_varying'] / ms['stock_constant']:.2f} (one batch size) | {ms['plugin_varying'] / ms['eager']:.2f} "
            "| – |"
        )
    return "\n".join(lines) + "\n"


#: The plot's bars, in order, and their colours (stock grey/red, the plugin green).
_BARS = (("eager", "#999999"), ("stock_constant", "#4c72b0"), ("stock_varying", "#c44e52"), ("plugin_varying", "#55a868"))


def plot(data: dict, path: Path) -> bool:
    """Steady step time per configuration, one panel per model, stock against the
    plugin; False (no plot) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    batch = next((r for r in data["results"] if r.get("model") == "varying_batch"), None)
    panels = [m for m in MODELS if _rows(data, m)]
    columns = len(panels) + bool(batch)
    fig, axes = plt.subplots(2, columns, figsize=(5.5 * columns, 8.0), squeeze=False)
    width = 0.8 / len(_BARS)
    for ax, model in zip(axes[0], panels):
        rows = _rows(data, model)
        variants = [v for v in VARIANTS if (v, "eager") in rows]
        for i, (config, colour) in enumerate(_BARS):
            bars = ax.bar(
                [j + (i - 1.5) * width for j in range(len(variants))],
                [rows[(v, config)]["steady_us"] / 1e3 for v in variants],
                width, label=config, color=colour,
            )
            ax.bar_label(bars, [str(rows[(v, config)]["compiles"]) for v in variants], fontsize=7)
        ax.set_xticks(range(len(variants)), variants)
        ax.set(title=f"{model}: steady step (on each bar: compiles)", ylabel="ms per step")
    for ax, model in zip(axes[1], panels):
        rows = _rows(data, model)
        variants = [v for v in VARIANTS if (v, "eager") in rows]
        for i, (config, colour) in enumerate(_BARS):
            ax.bar(
                [j + (i - 1.5) * width for j in range(len(variants))],
                [long_run_s(rows[(v, config)]) for v in variants], width, color=colour,
            )
        ax.set_xticks(range(len(variants)), variants)
        ax.set(title=f"{model}: {LONG_RUN:,} steps (first steps measured, then steady)", ylabel="seconds")
    if batch:
        axes[1][-1].axis("off")
    if batch:
        ax = axes[0][-1]
        configs = [c for c, _ in _BARS]
        ax.bar(configs, [batch["steady_ms"][c] for c in configs], color=[c for _, c in _BARS])
        ax.set_yscale("log")
        ax.set(title="message passing, batch size new every step", ylabel="ms per step (log)")
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"torch {data['torch']}, inductor, {data['machine']}, {data['date']}", fontsize=9)
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=len(_BARS), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def real_model_table(data: dict) -> str:
    """The real model without custom functions (``test_real_model.py``): each config's
    steady step, its ratio to stock's, and the first 50 steps' total."""
    rows = {r["config"]: r for r in data["results"]}
    stock = rows["stock_constant"]["steady_us"]
    names = {"eager": "eager", "stock_constant": "stock compiled autograd", "plugin_varying": "the plugin"}
    lines = [
        f"{data['model']}, inductor, torch {data['torch']}, {data['date']}; steady step: the smallest of "
        f"{rows['eager']['passes']} interleaved passes' medians.",
        "",
        "| config | steady step (µs) | ÷ stock | first 50 steps (s) | captures, compiles, breaks |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for config, name in names.items():
        r = rows[config]
        lines.append(
            f"| {name} | {r['steady_us']:,.0f} | {r['steady_us'] / stock:.3f} | {r['total_s']:.1f} "
            f"| {r['captures']}, {r['compiles']}, {r['breaks']} |"
        )
    return "\n".join(lines) + "\n"


#: What ``pytest benchmarks/test_dominance.py --benchmark-only`` writes.
DOMINANCE_RESULTS = HERE / "results" / "dominance.json"
DOMINANCE_COMMAND = COMMAND + " (dominance)"
#: The goals of the dominance matrix: the steady step where values repeat, and,
#: for a C++ function's numbers new every step, against stock's with constant values.
REPEATING_STEADY = 1.05
NEW_CPP_STEADY = {"mlp": 1.15, "elementwise": 1.10}
_CPP_NUMBERS = ("cpp_int_double", "cpp_sym", "cpp_numbers_hashed", "cpp_derived", "cpp_nontraceable")


def dominance_misses(rows: dict[tuple[str, str, str, str], dict], model: str, kind: str, schedule: str) -> list[str]:
    """Which goals a cell misses: compiles and the 2,000-step total above stock's; the
    steady step above ``REPEATING_STEADY`` x stock's where values repeat; a C++
    function's numbers new every step above ``NEW_CPP_STEADY`` x stock's constant."""
    stock, plugin = rows[(model, kind, schedule, "stock")], rows[(model, kind, schedule, "plugin")]
    misses = []
    if plugin["compiles"] > stock["compiles"]:
        misses.append(f"compiles {plugin['compiles']} > {stock['compiles']}")
    if plugin["long_run_s"] > stock["long_run_s"]:
        misses.append(f"{LONG_RUN:,} steps {plugin['long_run_s'] / stock['long_run_s']:.2f} x")
    ratio = plugin["steady_us"] / stock["steady_us"]
    if schedule != "new" and ratio > REPEATING_STEADY:
        misses.append(f"steady {ratio:.2f} x")
    if schedule == "new" and kind in _CPP_NUMBERS:
        constant = plugin["steady_us"] / rows[(model, kind, "constant", "stock")]["steady_us"]
        if constant > NEW_CPP_STEADY[model]:
            misses.append(f"steady {constant:.2f} x stock's constant")
    return misses


def dominance_table(data: dict) -> str:
    """Every cell of the matrix (``test_dominance.py``): stock and the plugin's
    compiles, steady step and 2,000-step total, and the goals it misses."""
    rows = {(r["model"], r["kind"], r["schedule"], r["config"]): r for r in data["results"]}
    cells = sorted({k[:3] for k in rows}, key=lambda c: (c[0], KINDS.index(c[1]), SCHEDULES.index(c[2])))
    first = {r["schedule"]: r["steps"] for r in data["results"]}
    measured = ", ".join(f"{first[schedule]} {schedule}" for schedule in SCHEDULES)
    missed = 0
    lines = [
        f"torch {data['torch']}, inductor, {data['machine']}, {data['date']}. Compiles: after the first "
        f"steps measured ({measured}); steady step: the smallest of the passes' medians "
        f"(spread: largest / smallest); {LONG_RUN:,} steps: the first steps, then the steady step.",
        "",
        "| model | function | values | compiles stock → plugin | steady stock / plugin (µs) | ÷ stock | "
        f"{LONG_RUN:,} steps stock / plugin (s) | spread stock, plugin | misses |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | --- | --- |",
    ]
    for model, kind, schedule in cells:
        stock, plugin = rows[(model, kind, schedule, "stock")], rows[(model, kind, schedule, "plugin")]
        misses = dominance_misses(rows, model, kind, schedule)
        missed += bool(misses)
        lines.append(
            f"| {model} | {kind} | {schedule} | {stock['compiles']} → {plugin['compiles']} "
            f"| {stock['steady_us']:,.0f} / {plugin['steady_us']:,.0f} | {plugin['steady_us'] / stock['steady_us']:.2f} "
            f"| {stock['long_run_s']:.1f} / {plugin['long_run_s']:.1f} | {stock['spread']:.2f}, {plugin['spread']:.2f} "
            f"| {'; '.join(misses) or '-'} |"
        )
    lines += ["", f"{missed} of {len(cells)} cells miss a goal."]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    source = Path(argv[0]) if argv else HERE / "results" / "latest.json"
    data = json.loads(source.read_text())
    tables, short = table(data), summary(data)
    _docblocks.write(ROOT / "docs" / "benchmarks.md", COMMAND, tables)
    real = real_model_table(json.loads(REAL_MODEL_RESULTS.read_text()))
    _docblocks.write(ROOT / "docs" / "benchmarks.md", REAL_MODEL_COMMAND, real)
    print(real)
    if DOMINANCE_RESULTS.exists():
        dominance = dominance_table(json.loads(DOMINANCE_RESULTS.read_text()))
        _docblocks.write(ROOT / "docs" / "benchmarks.md", DOMINANCE_COMMAND, dominance)
        print(dominance)
    _docblocks.write(ROOT / "README.md", SUMMARY_COMMAND, short)
    print(short)
    print(tables)
    print("wrote docs/benchmarks.md and README.md's generated blocks", "and" if plot(data, PLOT) else "(no matplotlib: no plot)", PLOT.relative_to(ROOT) if PLOT.exists() else "")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
