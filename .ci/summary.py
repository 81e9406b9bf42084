"""Sum the stages' JUnit reports: one line per release, then the plain closing line."""

import sys
import xml.etree.ElementTree as ET

total = {"passed": 0, "failed": 0, "skipped": 0}
for path in sys.argv[1:]:
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    tests, skipped = int(suite.get("tests")), int(suite.get("skipped"))
    failed = int(suite.get("failures")) + int(suite.get("errors"))
    passed = tests - skipped - failed
    release = path.rsplit("junit-", 1)[1].removesuffix(".xml")
    print(f"torch {release}: {passed} passed, {failed} failed, {skipped} skipped ({float(suite.get('time')):.0f} s)")
    total["passed"] += passed
    total["failed"] += failed
    total["skipped"] += skipped
print(f"CI: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
