"""ca-dynsaved demo [--backend B] [--steps N]
ca-dynsaved run [--backend B] [--compare] script.py [args]
ca-dynsaved selfcheck    (the check an untested torch must pass)
ca-dynsaved counters     (what each of the plugin's counters counts)

(``python -m ca_dynsaved`` is the same command.)"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    if command == "run":
        from .run import main as run_main

        return run_main(rest)
    if command == "selfcheck":
        from .selfcheck import main as selfcheck_main

        return selfcheck_main(rest)
    if command == "counters":
        from .counting import main as counters_main

        return counters_main(rest)
    print(f"unknown command {command!r}; see `ca-dynsaved --help`", file=sys.stderr)
    return 2


def cli() -> int:
    """The ``ca-dynsaved`` console script."""
    return main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(cli())
