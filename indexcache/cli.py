"""The ``indexcache`` command. Each subcommand registers itself through one ``_add_*`` function."""

from __future__ import annotations

import argparse
import sys


class UsageError(Exception):
    """Bad input from the command line: printed on stderr, exit status 2, no traceback."""


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="which backend is selected and why; every backend's availability")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run_info)


def _run_info(args) -> int:
    import json

    from indexcache.report import backend_summary

    summary = backend_summary()
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"selected backend: {summary['selected']} ({summary['why']})")
    for b in summary["backends"]:
        state = f"available, {b['mode']} on {b['device']}" if b["available"] else "not available"
        print(f"  {b['name']:<8} {state}: {b['reason']}")
    return 0


COMMANDS = (_add_info,)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="indexcache",
        description="IndexCache: cross-layer reuse of sparse-attention top-k indices, on any backend.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, ValueError, TypeError, FileNotFoundError) as exc:
        print(f"indexcache {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
