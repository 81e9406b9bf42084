"""Write benchmarks/RESULTS.md (and RESULTS.png where matplotlib is installed) from
benchmarks/results/latest.json, which ``pytest benchmarks/ --benchmark-only`` writes.

    python benchmarks/report.py [results.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


MODELS = {
    "mlp": "MLP 4x512, batch 64, 4 custom-function nodes (matmul-bound)",
    "elementwise": "elementwise, 3 layers of act(x * w + b) on 1024x1024, 3 custom-function nodes (fusion-sensitive)",
}
CONFIGS = ("eager", "stock_constant", "stock_varying", "plugin_varying", "plugin_opaque_varying", "plugin_trust_varying")


def table(data: dict) -> str:
    first = next(r for r in data["results"] if r.get("model") not in ("capture", "chain", "varying_batch"))
    lines = [
        f"Total: the first {first['steps']} steps, compiles included; steady: the smallest "
        f"of {first.get('passes', 3)} passes' median step, values still changing; backend "
        f"{first['backend']}; torch {data['torch']}; {data['machine']}; {data['date']}. "
        "Ratios are against stock compiled autograd in the same run, with values that "
        "never change (stock_constant, the floor) and that change every step (stock_varying).",
    ]
    for model, title in MODELS.items():
        rows = {(r["variant"], r["config"]): r for r in data["results"] if r.get("model", "mlp") == model}
        if not rows:
            continue
        variants = sorted({v for v, _ in rows}, key=["cpp", "cpp_sym", "cpp_direct", "python", "hashed"].index)
        lines += [
            "",
            f"Model: {title}.",
            "",
            "| variant | config | compiles | captures | opaque nodes | total s | steady µs/step | "
            "total / stock_constant | total / stock_varying | steady / stock_constant | "
            "steady / stock_varying | µs per opaque node |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for v in variants:
            floor, varying = rows.get((v, "stock_constant")), rows.get((v, "stock_varying"))
            for config in CONFIGS:
                r = rows.get((v, config))
                if r is None or floor is None or varying is None:
                    continue
                per_node = (
                    f"{(r['steady_us'] - floor['steady_us']) / r['opaque_nodes']:.0f}"
                    if r["opaque_nodes"] else ""
                )
                lines.append(
                    f"| {v} | {config} | {r['compiles']} | {r['captures']} | {r['opaque_nodes']} | "
                    f"{r['total_s']:.2f} | {r['steady_us']:.0f} | {r['total_s'] / floor['total_s']:.2f} | "
                    f"{r['total_s'] / varying['total_s']:.2f} | {r['steady_us'] / floor['steady_us']:.2f} | "
                    f"{r['steady_us'] / varying['steady_us']:.2f} | {per_node} |"
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
    direct = {r["config"]: r for r in data["results"] if r.get("variant") == "cpp_direct" and r.get("model") == "elementwise"}
    if "plugin_varying" in direct and "plugin_trust_varying" in direct:
        cost = direct["plugin_varying"]["steady_us"] - direct["plugin_trust_varying"]["steady_us"]
        lines += [
            "",
            f"verify's cost per new value (cpp_direct, 3 nodes, every step new): "
            f"{cost:.0f} µs a step, {cost / 3:.0f} µs per node (plugin_varying - plugin_trust_varying, steady).",
        ]
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = sorted({(r.get("model", "mlp"), r["variant"]) for r in data["results"] if "step_s" in r})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (m, v) in zip(axes[0], panels):
        for r in data["results"]:
            if (r.get("model", "mlp"), r["variant"]) == (m, v) and "step_s" in r:
                total, cumulative = 0.0, []
                for t in r["step_s"]:
                    total += t
                    cumulative.append(total)
                ax.plot(range(1, len(cumulative) + 1), cumulative, label=r["config"])
        ax.set(title=f"{m} / {v}", xlabel="step", ylabel="cumulative seconds")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return True


def main(argv: list[str]) -> int:
    source = Path(argv[0]) if argv else HERE / "results" / "latest.json"
    data = json.loads(source.read_text())
    (HERE / "RESULTS.md").write_text(table(data))
    print(table(data))
    print("wrote", HERE / "RESULTS.md", "and RESULTS.png" if plot(data, HERE / "RESULTS.png") else "(no matplotlib: no plot)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
