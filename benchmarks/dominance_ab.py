"""One cell of the dominance matrix measured again as A/B pairs: stock and the plugin
alternate, each pass from a fresh state, ``WARM`` steps then the median of 30 timed
steps; prints each config's pass medians and the plugin ÷ stock ratio of their medians
and of their fastest passes. A cell's single steady figure in ``test_dominance.py`` has
a spread as wide as the goals it checks; this says whether a miss is real.

    cd benchmarks && python dominance_ab.py MODEL KIND SCHEDULE [PASSES] [WARM]

(docs/benchmarks.md: 8 passes, WARM 40, 80 for a cycle: past a cycle's later graphs.)"""

from __future__ import annotations

import gc
import statistics
import sys

from dominance import build_extension, model
from harness import _counts, _fresh
from test_dominance import _train


def main(model_name: str, kind: str, schedule: str, passes: int = 6, warm: int = 40) -> None:
    net, x = model(model_name, kind, build_extension())
    medians: dict[str, list[float]] = {"stock": [], "plugin": []}
    counts: dict[str, dict[str, int]] = {}
    step = 0
    for n in range(passes):
        for config in ("stock", "plugin") if n % 2 == 0 else ("plugin", "stock"):
            _fresh()
            gc.collect()
            _train(net, x, schedule, config, warm, step, "inductor")
            medians[config].append(statistics.median(_train(net, x, schedule, config, 30, step + warm, "inductor")) * 1e6)
            counts[config] = _counts()
            step += warm + 30
    for config, values in medians.items():
        print(config, [round(v) for v in values], "fastest", round(min(values)),
              "median", round(statistics.median(values)), counts[config])
    print("plugin / stock: median", round(statistics.median(medians["plugin"]) / statistics.median(medians["stock"]), 3),
          "fastest", round(min(medians["plugin"]) / min(medians["stock"]), 3))


if __name__ == "__main__":
    main(*sys.argv[1:4], *(int(a) for a in sys.argv[4:6]))
