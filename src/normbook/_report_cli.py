"""``normbook-report``'s command line: its arguments, its help and its refusals.

It lies outside :mod:`normbook.kernels` because that package imports Triton as it is imported
(and says so, in an ImportError, where Triton is missing): the console script points here, so
that ``normbook-report --help`` prints and a report is refused in one line without Triton. The
report itself, :mod:`normbook.kernels.report`, is imported only once nothing has refused.
``python -m normbook.kernels.report`` runs the same :func:`main`, after the package's import.
"""

from __future__ import annotations

import argparse
import os
import sys

ARCHS = (80, 90)   # what --archs accepts, and its default: the plans, the model and the goal are sm_80's and sm_90's


class Refusal(Exception):
    """A refusal of the command line: one line on stderr, exit status 2."""


def parse_archs(text: str) -> tuple[int, ...]:
    """--archs: a comma list of :data:`ARCHS` (each once, in the order given)."""
    try:
        archs = tuple(dict.fromkeys(int(a) for a in text.split(",")))
    except ValueError:
        archs = ()
    bad = [a for a in archs if a not in ARCHS]
    if not archs or bad:
        raise Refusal(f"--archs: expected a comma list of {','.join(map(str, ARCHS))} (the "
                      f"compute capabilities the report compiles for), got {text!r}"
                      + (f" (cannot compile for {','.join(f'sm_{a}' for a in bad)})" if bad else ""))
    return archs


def can_compile():
    """Refuse (:class:`Refusal`) where the report cannot compile, else return the module
    :mod:`normbook.kernels.report`: TRITON_INTERPRET set, by the kernels' rule (any value but
    "" and "0": ``_backward.INTERPRETED``), which makes Triton's interpreter stand in for its
    compiler; or no Triton (``import triton`` fails, or report.py's own imports of Triton's
    compiler do)."""
    # Triton first: without it, unsetting TRITON_INTERPRET would only lead to this refusal
    try:
        import triton  # noqa: F401
    except ImportError as e:
        failed = f"{type(e).__name__}: {e}"
    else:
        value = os.environ.get("TRITON_INTERPRET", "")
        if value not in ("", "0"):
            raise Refusal(f"TRITON_INTERPRET={value!r} is set, so Triton's interpreter stands "
                          "in for the compiler the report runs (it compiles real GPU code); "
                          "unset TRITON_INTERPRET (env -u TRITON_INTERPRET normbook-report ...)")
        from normbook.kernels import report

        if report.NO_TRITON is None:
            return report
        failed = report.NO_TRITON
    raise Refusal("needs Triton to compile the kernels (Linux: pip install 'normbook[kernels]'); "
                  f"importing it failed: {failed}")


class _Parser(argparse.ArgumentParser):
    """Refusals in one line, as the report's own are (not argparse's usage block above)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="normbook-report",
        description="The static compile report: every kernel compiled for sm_80 and sm_90 on a "
                    "machine without a GPU.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  normbook-report --quick                 # sm_90, bf16, two widths: a minute\n"
               "  normbook-report --json report.json      # every configuration, sm_80 and sm_90:\n"
               "                                          # minutes (a line per tenth done)\n"
               "  python -m normbook.kernels.report --archs 90 --no-progress\n"
               "needs Triton, and TRITON_INTERPRET unset (the report compiles, not interprets)\n"
               "exit status: 0 when every configuration compiles without a problem, 1 otherwise,\n"
               "2 for a refusal (one line: an arch, --json, no Triton, TRITON_INTERPRET set)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH "
                        "(checked before anything is compiled; a file that exists is refused "
                        "unless --force)")
    parser.add_argument("--force", action="store_true",
                        help="replace the --json file if it exists (a recorded run's report, "
                        "from the GPU machine's Triton, cannot be made again here)")
    parser.add_argument("--quick", action="store_true", help="sm_90, bf16, D in (3000, 65536) only, the fused add at 3000")
    parser.add_argument("--archs", help="comma list of compute capabilities, of "
                        f"{','.join(map(str, ARCHS))} (default: all)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress on stderr (by default a bar on a terminal, else a line "
                        "every tenth of the way)")
    from normbook import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def main(argv=None) -> int:
    """The command line (``normbook-report``); returns the exit status: 0 when every
    configuration compiles without a problem, 1 otherwise, 2 for a refusal (one line)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from normbook.bench.cli import BenchError, new_file, writable_file

    try:   # every refusal before the first compile
        archs = None if args.archs is None else parse_archs(args.archs)
        writable_file("--json", args.json)
        new_file("--json", args.json, args.force)
        report = can_compile()
    except (Refusal, BenchError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    return report.print_report(quick=args.quick, archs=archs, json_path=args.json,
                               progress=False if args.no_progress else None)


if __name__ == "__main__":   # python -m normbook._report_cli, as normbook-report
    sys.exit(main())
