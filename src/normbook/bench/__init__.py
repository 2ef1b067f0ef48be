"""normbook.bench: how fast the norms run, measured against the memory they must move.

A norm is memory-bound, so each row of the benchmark is bytes (from the byte model in
:mod:`normbook.bench.bytemodel`) over the median time, in GB/s, and as a fraction of the copy
bandwidth measured in the same run. Files, one topic each:

    bytemodel   the bytes each (op, mode) moves, declared as data
    model       the H200's numbers and programs per SM (the speed model was retired: see it)
    providers   normbook, torch, compile, naive, reference, liger, quack
    timing      do_bench on CUDA (a perf_counter loop on the CPU), the copy bandwidth
    runner      the sweep, provenance, the JSON
    schema      what a results file holds, checked before it is read (one-line errors)
    plot        figures and a caption line from recorded JSON
    host        ``normbook-bench host``: host time per call (real launches, or the driver stubbed)
    cpu         ``normbook-bench cpu``: the CPU backend against torch on the CPU
    cli         ``normbook-bench`` (or ``python -m normbook.bench``): the command line

Importing this package imports neither triton nor matplotlib; both load when used.
"""

from normbook.bench.bytemodel import bytes_moved, traffic
from normbook.bench.plot import load_results, plot_results, provenance_line
from normbook.bench.runner import Config, run

__all__ = ["bytes_moved", "traffic", "Config", "run", "load_results", "plot_results",
           "provenance_line"]
