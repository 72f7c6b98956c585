"""Command line: ``python -m detsum report [--quick] [--json PATH] [--plot PATH]``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m detsum")
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser(
        "report",
        help="accuracy, agreement with torch's autograd, determinism and speed on this device")
    # Imported here: the report pulls in every primitive and Numba.
    from detsum import report as report_module

    report_module.add_arguments(report)
    args = parser.parse_args(argv)
    if args.command == "report":
        return report_module.run_command(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
