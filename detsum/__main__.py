"""Command line: ``python -m detsum report [--quick] [--wide] [--json PATH] [--plot PATH]`` and
``python -m detsum figures [--quick] [--out DIR] [--json PATH]``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m detsum")
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser(
        "report",
        help="accuracy, agreement with torch's autograd, determinism and speed on this device")
    figures = commands.add_parser(
        "figures", help="draw the documentation's accuracy and speed pictures (PNG)")
    # Imported here: the report pulls in every primitive and Numba.
    from detsum import figures as figures_module
    from detsum import report as report_module

    report_module.add_arguments(report)
    figures_module.add_arguments(figures)
    args = parser.parse_args(argv)
    if args.command == "report":
        return report_module.run_command(args)
    if args.command == "figures":
        return figures_module.run_command(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
