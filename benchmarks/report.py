"""Write benchmarks/RESULTS.md (and RESULTS.png where matplotlib is installed) from
benchmarks/results/latest.json, which ``pytest benchmarks/ --benchmark-only`` writes.

    python benchmarks/report.py [results.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def table(data: dict) -> str:
    rows = {(r["variant"], r["config"]): r for r in data["results"]}
    variants = sorted({v for v, _ in rows}, key=["cpp", "python", "hashed"].index)
    lines = [
        f"Benchmark: MLP 4x512, batch 64, 4 custom-function nodes, "
        f"total: the first {data['results'][0]['steps']} steps, compiles included; steady: median "
        f"step of the next ones; backend {data['results'][0]['backend']}; "
        f"torch {data['torch']}; {data['machine']}; {data['date']}.",
        "",
        "| variant | config | compiles | captures | total s | steady µs/step | total / stock_constant | "
        "total / stock_varying | steady / stock_constant | µs per opaque node |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in variants:
        floor, varying = rows.get((v, "stock_constant")), rows.get((v, "stock_varying"))
        for config in ("eager", "stock_constant", "stock_varying", "plugin_varying"):
            r = rows.get((v, config))
            if r is None:
                continue
            per_node = (
                f"{(r['steady_us'] - floor['steady_us']) / r['opaque_nodes']:.0f}"
                if r["opaque_nodes"] and floor else ""
            )
            lines.append(
                f"| {v} | {config} | {r['compiles']} | {r['captures']} | {r['total_s']:.2f} | "
                f"{r['steady_us']:.0f} | {r['total_s'] / floor['total_s']:.2f} | "
                f"{r['total_s'] / varying['total_s']:.2f} | {r['steady_us'] / floor['steady_us']:.2f} | {per_node} |"
            )
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    variants = sorted({r["variant"] for r in data["results"]})
    fig, axes = plt.subplots(1, len(variants), figsize=(5 * len(variants), 4), squeeze=False)
    for ax, v in zip(axes[0], variants):
        for r in data["results"]:
            if r["variant"] == v:
                total, cumulative = 0.0, []
                for t in r["step_s"]:
                    total += t
                    cumulative.append(total)
                ax.plot(range(1, len(cumulative) + 1), cumulative, label=r["config"])
        ax.set(title=v, xlabel="step", ylabel="cumulative seconds")
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
