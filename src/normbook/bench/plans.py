"""Plans timed on the device both ways: the backward of few rows; the forward of short rows.

    normbook-bench plans [--json FILE [--force]] [--dims 1024,4096,8192] [--rows 1,2,4,8,16,32]
                         [--share-rows 32768] [--finish-blocks 64,32,16]
                         [--forward-dims 1024,2048]

The rows backward with a weight keeps sums over rows (dweight, dbias). On a grid of several
programs each keeps partial sums, and a second kernel, the finish, adds them in a fixed order;
one program writes the sums itself: one launch, no partials to allocate, but its rows run one
after another. The kernels plan one program for at most ``ONE_PROGRAM_ROWS`` rows
(:mod:`normbook.kernels._config`), a choice made for host time, whose device cost this
measures: LayerNorm with weight and bias, bf16, for each D and M:

- ``one_us``: the backward as one program;
- ``grid_us``: the backward on the persistent grid (``grid_programs`` programs), with its
  finish;
- ``finish_us``: the finish alone, on that grid's partials, and ``finish_share``, its part
  of ``grid_us`` (``--share-rows``: large batches, where only the grid is timed);
- ``finish_block_us``, for the large batches: the finish alone with each column width of
  ``--finish-blocks`` (``_config.FINISH_BLOCK_D``; D / width programs, the same
  ``FINISH_BLOCK_P`` partial rows a step, so the same sums in the same order: the same bits).
  The finish runs on D / 64 programs today, 64 of an H200's 132 SMs at D = 4096 and 16 at
  D = 1024: whether more, narrower programs make it cheaper is for this to measure.

The forward of rows shorter than ``_config.ROW_FROM`` shares tiles of several rows among the
programs of a persistent grid; from it on, on a GPU, a row is a program, grid M (Liger's shape,
measured faster than the tiles from D = 4096 to 16384 on the H200). Whether rows of 1024 and
2048 values are faster as a program each, as Liger runs them, was not measured: for each D of
``--forward-dims`` at each M of ``--share-rows``, LayerNorm with weight and bias, bf16,
``tiles_us`` and ``row_us`` time the forward both ways (``tiles_programs``, ``row_programs``:
their grids), in the JSON's ``forward``.

Device time: :func:`normbook.bench.timing.bench` (replays of a CUDA graph on a GPU; on a CPU,
in Triton's interpreter, wall clock, which says only that the code runs). JSON, written again
after every row: ``rows`` and ``forward``, lists of those keys with ``D`` and ``M`` (a row
whose measurement raised holds its ``error`` instead, and the command goes on; its exit
status stays 0), the device, the versions, ``one_program_rows`` and ``row_from``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch

__all__ = ["main", "measure", "measure_forward", "one_program_rows", "row_from"]

DESCRIPTION = __doc__.split("\n\n")[0]
EXAMPLES = """examples:
  normbook-bench plans --json plans.json      # on a GPU: every D and M
  TRITON_INTERPRET=1 normbook-bench plans --dims 2048 --rows 1,4 --share-rows 64 \\
      --forward-dims 1024                     # on a CPU: the code runs; its times mean nothing
"""


@contextlib.contextmanager
def one_program_rows(n: int):
    """Plans made with ``_config.ONE_PROGRAM_ROWS = n`` for the duration (0: never one
    program), the plans cached before and after forgotten."""
    from normbook.kernels import _config

    was = _config.ONE_PROGRAM_ROWS
    _config.ONE_PROGRAM_ROWS = n
    _config.backward_plan.cache_clear()
    try:
        yield
    finally:
        _config.ONE_PROGRAM_ROWS = was
        _config.backward_plan.cache_clear()


@contextlib.contextmanager
def row_from(block_d: int):
    """Forward plans made with ``_config.ROW_FROM = block_d`` for the duration (on a GPU, rows
    of that BLOCK_D and wider a program each), the plans cached before and after forgotten."""
    from normbook.kernels import _config

    was = _config.ROW_FROM
    caches = (_config.forward_plan, _config.forward_config)
    _config.ROW_FROM = block_d
    for cached in caches:
        cached.cache_clear()
    try:
        yield
    finally:
        _config.ROW_FROM = was
        for cached in caches:
            cached.cache_clear()


def measure_forward(dims, share_rows, device: str, out=None, done=None) -> list[dict]:
    """One dict per (D, M): the forward on the plan in force and as a row a program. ``out``:
    the list to append to (each row as it is measured), ``done``: called after each row (the
    JSON written again); a row whose measurement raised holds its ``error`` instead."""
    from normbook.bench.timing import bench
    from normbook.kernels import _config, _forward

    out = [] if out is None else out
    for D in dims:
        for M in share_rows:
            row = {"D": D, "M": M}
            try:
                g = torch.Generator().manual_seed(M * 5 + D)
                x = torch.randn(M, D, generator=g).to(device, torch.bfloat16)
                w, b = (torch.randn(D, generator=g).to(device, torch.bfloat16)
                        for _ in range(2))
                index = x.get_device()
                for name, block in (("tiles", _config.ROW_FROM), ("row", 1)):
                    with row_from(block):
                        def forward():
                            return _forward.norm_forward(x, None, w, b, 1e-5, False)

                        forward()       # compiled and measured: the plan's final grid
                        plan = _config.forward_plan(M, D, index, 2, False, False, True, True,
                                                    D & 15)[0]
                        row[f"{name}_us"] = 1e3 * bench(forward, device)[0]
                        row[f"{name}_programs"] = plan.grid[0]
                line = (f"forward D {D:6d} M {M:6d}  tiles {row['tiles_us']:8.2f} us "
                        f"({row['tiles_programs']} programs)  a row a program "
                        f"{row['row_us']:8.2f} us ({row['row_programs']} programs)")
            except Exception as e:  # noqa: BLE001 - one row's failure must not lose the rest
                row["error"] = f"{type(e).__name__}: {e}"
                line = f"forward D {D:6d} M {M:6d}  failed: {row['error']}"
            out.append(row)
            print(line, flush=True)
            if done is not None:
                done()
    return out


def _case(M: int, D: int, device: str, finish_block: int = 0):
    """(backward call, finish call or None, programs) on the plan in force for (M, D); the
    finish with columns of ``finish_block`` (0: the plan's, FINISH_BLOCK_D)."""
    from normbook.kernels import _backward, _config, _forward, _launch

    g = torch.Generator().manual_seed(M * 7 + D)
    x, dy = (torch.randn(M, D, generator=g).to(device, torch.bfloat16) for _ in range(2))
    w, b = (torch.randn(D, generator=g).to(device, torch.bfloat16) for _ in range(2))
    _, _, stats = _forward.norm_forward(x, None, w, b, 1e-5, False)

    def backward():
        return _backward.norm_backward(dy, None, x, w, stats, torch.bfloat16, False)

    backward()     # compiled, measured (a GPU plans its grid after the first launch), warm
    index = x.get_device()
    plans = _config.backward_plan(M, D, index, 2, False, False, True, True, D & 15, False)
    if len(plans) == 1:
        return backward, None, plans[0].grid[0]
    main, finish = plans
    if finish_block:
        finish = _config.finish_plan(D, True, True, main.groups, finish_block)
    pw, pb = torch.zeros(2, main.groups, D, device=device)
    ow, ob = torch.empty(D, device=device, dtype=torch.bfloat16), torch.empty_like(w)
    kernel = _backward._KERNELS[finish.kernel]

    def finish_only():
        _launch.launch(kernel, finish.grid, (pw, pb, ow, ob, main.groups, D), finish.flags,
                       None, index)

    return backward, finish_only, main.grid[0]


def measure(dims, rows, share_rows, device: str, finish_blocks=(), out=None,
            done=None) -> list[dict]:
    """One dict per (D, M): see the module docstring. ``out``, ``done``: as
    :func:`measure_forward`'s; a row whose measurement raised holds its ``error``."""
    out = [] if out is None else out
    for D in dims:
        for M in (*rows, *share_rows):
            row = {"D": D, "M": M, "one_us": None}
            try:
                _measure_row(row, D, M, rows, share_rows, device, finish_blocks)
                line = _line(row)
            except Exception as e:  # noqa: BLE001 - one row's failure must not lose the rest
                row["error"] = f"{type(e).__name__}: {e}"
                line = f"D {D:6d} M {M:6d}  failed: {row['error']}"
            out.append(row)
            print(line, flush=True)
            if done is not None:
                done()
    return out


def _measure_row(row: dict, D: int, M: int, rows, share_rows, device: str, finish_blocks):
    """:func:`measure`'s row for (D, M), filled in place."""
    from normbook.bench.timing import bench

    if M in rows:
        with one_program_rows(M):
            fn, _, programs = _case(M, D, device)
            assert programs == 1, programs
            row["one_us"] = 1e3 * bench(fn, device)[0]
    with one_program_rows(0):
        fn, finish, programs = _case(M, D, device)
        row["grid_us"] = 1e3 * bench(fn, device)[0]
        row["grid_programs"] = programs
        row["finish_us"] = None if finish is None else 1e3 * bench(finish, device)[0]
    row["finish_share"] = (None if row["finish_us"] is None
                           else row["finish_us"] / row["grid_us"])
    if M in share_rows and finish is not None:
        row["finish_block_us"] = {}
        with one_program_rows(0):
            for block in finish_blocks:
                finish = _case(M, D, device, block)[1]
                row["finish_block_us"][str(block)] = 1e3 * bench(finish, device)[0]


def _line(row: dict) -> str:
    f = (lambda v, fmt: "-" if v is None else format(v, fmt))
    blocks = "".join(f"\n    finish with columns of {b}: {us:7.2f} us"
                     for b, us in row.get("finish_block_us", {}).items())
    return (f"D {row['D']:6d} M {row['M']:6d}  one {f(row['one_us'], '8.2f')} us  grid "
            f"{row['grid_us']:8.2f} us ({row['grid_programs']} programs)  finish "
            f"{f(row['finish_us'], '7.2f')} us = {f(row['finish_share'], '.3f')} of it{blocks}")


def main(argv=None) -> int:
    """``normbook-bench plans``; 0. A refusal raises (printed by :mod:`normbook.bench.cli`)."""
    import argparse

    from normbook.bench.cli import PROG, BenchError, Parser, _sizes, add_json_out, json_out

    p = Parser(prog=f"{PROG} plans", description=DESCRIPTION, epilog=EXAMPLES,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    add_json_out(p, "the rows")
    p.add_argument("--dims", default="1024,4096,8192", help="D, comma-separated")
    p.add_argument("--rows", default="1,2,4,8,16,32", help="M timed both ways")
    p.add_argument("--share-rows", default="32768", help="M timed on the grid alone")
    p.add_argument("--finish-blocks", default="64,32,16",
                   help="column widths of the finish timed at --share-rows (powers of two)")
    p.add_argument("--forward-dims", default="1024,2048",
                   help="D of the forward timed on tiles and as a row a program, at "
                        "--share-rows")
    args = p.parse_args(argv)
    dims, rows = _sizes(p, "--dims", args.dims), _sizes(p, "--rows", args.rows)
    share = _sizes(p, "--share-rows", args.share_rows)
    blocks = _sizes(p, "--finish-blocks", args.finish_blocks)
    forward_dims = _sizes(p, "--forward-dims", args.forward_dims)
    if any(b & (b - 1) or b < 4 for b in blocks):
        p.error(f"--finish-blocks: powers of two of at least 4, got {args.finish_blocks}")
    json_out(args)
    try:
        import triton
        from normbook.kernels import _config
    except ImportError as e:
        raise BenchError(f"the kernels it times cannot be imported: {e}") from None
    if max(dims) > _config.MAX_FUSED_D_BWD:
        raise BenchError(f"--dims: the rows backward takes D up to {_config.MAX_FUSED_D_BWD}, "
                         f"got {max(dims)}")
    if max(forward_dims) > _config.MAX_FUSED_D_FWD:
        raise BenchError(f"--forward-dims: the rows forward takes D up to "
                         f"{_config.MAX_FUSED_D_FWD}, got {max(forward_dims)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise BenchError("no CUDA device: set TRITON_INTERPRET=1 to run it in Triton's "
                         "interpreter (which says only that it runs)")
    found: list = []
    forward: list = []
    record = {"rows": found, "forward": forward,
              "device": torch.cuda.get_device_name() if device == "cuda"
              else "cpu (Triton's interpreter)",
              "torch": torch.__version__, "triton": triton.__version__,
              "one_program_rows": _config.ONE_PROGRAM_ROWS, "row_from": _config.ROW_FROM}

    def write():
        """The JSON so far, after every row (a run stopped at its limit keeps what it
        measured), replaced whole: written beside it, then renamed."""
        if args.json:
            part = f"{args.json}.part"
            with open(part, "w") as f:
                json.dump(record, f, indent=1)
            os.replace(part, args.json)

    measure(dims, rows, share, device, blocks, out=found, done=write)
    measure_forward(forward_dims, share, device, out=forward, done=write)
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
