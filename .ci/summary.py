"""The end of .ci/run: each stage's time, the tests per release, the 15 slowest tests.

    python3 .ci/summary.py OUT_DIR [TOTAL_SECONDS]

OUT_DIR holds ``stages.tsv`` (torch, installer, install s, pytest s, outcome; written
by .ci/run) and ``junit-<torch>.xml`` per stage. A test's time is its setup, call and
teardown (pytest's JUnit default): a module's first test carries the fixtures the
module shares (a launch of ranks, the demo's run).
"""

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SLOWEST = 15

out = Path(sys.argv[1])
print("\n=== stages (seconds) ===")
print(f"{'torch':<8} {'by':>3} {'install':>7} {'pytest':>6}  outcome")
for line in (out / "stages.tsv").read_text().splitlines():
    torch, installer, install, took, outcome = line.split("\t")
    print(f"{torch:<8} {installer:>3} {install:>7} {took:>6}  {outcome}")
if len(sys.argv) > 2:
    print(f"whole run: {int(sys.argv[2])} s")

total = {"passed": 0, "failed": 0, "skipped": 0}
timings = []
for path in sorted(out.glob("junit-*.xml")):
    release = path.name.removeprefix("junit-").removesuffix(".xml")
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    tests, skipped = int(suite.get("tests")), int(suite.get("skipped"))
    failed = int(suite.get("failures")) + int(suite.get("errors"))
    passed = tests - skipped - failed
    print(f"torch {release}: {passed} passed, {failed} failed, {skipped} skipped ({float(suite.get('time')):.0f} s)")
    total["passed"] += passed
    total["failed"] += failed
    total["skipped"] += skipped
    for case in suite.iter("testcase"):
        timings.append((float(case.get("time", 0)), release, f"{case.get('classname')}::{case.get('name')}"))

print(f"\n=== the {SLOWEST} slowest tests (setup + call + teardown) ===")
for seconds, release, name in sorted(timings, reverse=True)[:SLOWEST]:
    print(f"{seconds:7.1f} s  torch {release}  {name}")
print(f"\nCI: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
