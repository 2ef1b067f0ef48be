"""Kernel launches without Triton's per-call work, and the one stub seam for measuring them.

``kernel[grid](*args, **flags)`` (Triton's ``JITFunction.run``) does on every call: bind the
arguments to the kernel's signature, specialize each one, build a cache key from the
specializations and the options, look the compiled kernel up, and only then call its
launcher. On the H200 that was half of normbook's host time per call (a cProfile of 2000
forwards: 0.092 s of 0.167 s in ``JITFunction.run``; the H200 run of 2026-12-04, at 98327f3).

:func:`launch` does that work once per launch key. Triton specializes a compiled kernel on
each pointer's dtype and 16-byte alignment and on each integer's value 1, multiple of 16 and
32/64-bit range (``native_specialize_impl``, Triton 3.6 to 3.9 alike). A launcher that has
checked its pointers' alignment passes a key that decides the rest: the plan's
:attr:`~normbook.kernels._config.Plan.key` (kernel and flags), the tensors' dtypes and the
integers themselves. The first launch under a key goes through Triton's path, which compiles
(or finds) the kernel and returns it, and the kernel is kept under (key, device); later ones
call its launcher as ``JITFunction.run`` does after its lookup (Inductor's static launcher
does the same). A misaligned pointer takes Triton's path, which specializes on it.

Triton's path is taken every time where the shortcut would skip something that matters:
Triton's interpreter (no compiled kernel), launch hooks (a profiler's), a Triton this was not
read against and tested on (:data:`TESTED`), and a caller's ``key=None`` (a misaligned
pointer; a refused cooperative launch, relaunched without it).

:func:`stub_driver` replaces Triton's CUDA driver by one whose compiled kernels' launcher
does nothing: on a machine without a GPU, kernels compile for sm_90 for real and every line of
host code up to the launcher (normbook's; Triton's binding and lookup, or :func:`launch`'s)
runs, on CPU tensors. ``normbook-bench host`` measures with it, and the tests compare the
direct launch with Triton's, argument for argument.

Two things every launcher needs besides: :func:`other_device` (Triton launches on the current
device, so a launcher for tensors on another makes theirs current), and, at a plan's first
launch on a GPU, :func:`measure`, which compiles the kernel without running it and records
how many of its programs an SM holds, so that the plans size their grids by the compiled
kernel rather than by an assumption.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from typing import Iterator, Optional

import torch
import triton
from triton import knobs
from triton.runtime import driver as _drivers
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

__all__ = ["launch", "direct", "stub_driver", "TESTED", "compiled_variants", "kept", "plain",
           "READY", "forget_ready", "measure", "other_device"]

# Triton versions whose JITFunction.run this mirrors, and is tested on: the launcher call at its
# end is the same line in all four (read), and tests/test_kernels_launch.py compares the direct
# launch with Triton's under each (3.6 in make torch-floor, 3.7 and 3.8 in make triton-versions,
# 3.9 the pins). 3.7 and 3.8 are what PyPI's CUDA builds of torch 2.12 to 2.14 pin: without them,
# Triton's path on every call there
TESTED = ("3.6", "3.7", "3.8", "3.9")

_DIRECT = ".".join(triton.__version__.split(".")[:2]) in TESTED
MAX_KEPT = 4096          # entries of the kept kernels' table before it is cleared
# (a launcher's key, device) -> (the compiled kernel's launcher, its function handle, packed
# metadata, constexpr values in signature order): what JITFunction.run passes the launcher
_compiled: dict = {}
# the front door's ready calls (normbook.functional._norm): its key -> a Ready of _forward,
# holding kept kernels; forgotten with them
READY: dict = {}


def forget_ready() -> None:
    """Empty :data:`READY`, and mark each Ready it held no longer live: a module keeps the
    ones it launched (``functional._module_norm``), and must not launch their kernels again
    once they are forgotten (a stub's, say, after it is gone). Taken out one at a time: other
    threads' first calls of a signature add to it meanwhile (a loop over the table raised
    'dictionary changed size during iteration' in the launch that filled the kept kernels)."""
    while READY:
        try:
            made = READY.popitem()[1]
        except KeyError:        # (another thread emptied it first)
            break
        if made:
            made.live = False


def direct(kernel) -> bool:
    """Whether :func:`launch` may call ``kernel``'s compiled launcher itself: a compiled
    ``@triton.jit`` kernel (not the interpreter's, nor a stand-in) on a Triton in
    :data:`TESTED`."""
    return _DIRECT and type(kernel) is JITFunction


def plain() -> bool:
    """Whether launches may skip Triton's path now: a :data:`TESTED` Triton, direct launches
    on (:data:`_DIRECT`), no launch hook set (a hook that is not a HookChain is one that is
    set)."""
    rt = knobs.runtime
    return _DIRECT and not (getattr(rt.launch_enter_hook, "calls", True)
                            or getattr(rt.launch_exit_hook, "calls", True))


def kept(key: tuple, device: int):
    """The kept kernel of a launcher's ``key`` on ``device``, as :func:`launch` calls it: (its
    launcher, its function handle, packed metadata, constexpr values), or None."""
    return _compiled.get((key, device))


def compiled_variants() -> int:
    """How many compiled kernels :func:`launch` keeps (one per key and device)."""
    return len(_compiled)


def launch(kernel, grid: tuple, args: tuple, flags: dict, key: Optional[tuple] = None,
           device: int = 0) -> None:
    """``kernel[grid](*args, **flags)``, without Triton's per-call binding and lookup once the
    same ``key`` has launched on the same device (see the module docstring).

    Args:
        kernel: the ``@triton.jit`` function.
        grid: (programs,).
        args: the runtime arguments, positionally, in the kernel's order; the constexprs and
            launch options come in ``flags``, by name.
        key: None for Triton's path; else a hashable value that decides everything Triton
            specializes these arguments on, given that every pointer among them is 16-byte
            aligned (the caller checks that): the plan's key, the tensors' dtypes and the
            integers' values (more than Triton needs: a new M adds an entry that finds the
            same compiled kernel).
        device: the CUDA device the launch runs on, the current one (the launchers make it so).
    """
    # a kept kernel (only JITFunctions on a TESTED Triton are kept), with no launch hook set
    # (a hook that is not a HookChain is one that is set)
    hit = None if key is None or not _DIRECT else _compiled.get((key, device))
    if hit is not None:
        rt = knobs.runtime
        if not (getattr(rt.launch_enter_hook, "calls", True)
                or getattr(rt.launch_exit_hook, "calls", True)):
            run, function, metadata, consts = hit
            run(grid[0], 1, 1, _drivers.active.get_current_stream(device), function, metadata,
                None, None, None, *args, *consts)
            return
    if key is None or not direct(kernel):
        kernel[grid](*args, **flags)
        return
    compiled = kernel[grid](*args, **flags)
    try:
        # the constexprs after the arguments, in order: a flag the plan leaves out takes the
        # kernel's default (ROUND_XHAT)
        kept = (compiled.run, compiled.function, compiled.packed_metadata,
                tuple(flags[p.name] if p.name in flags else p.default
                      for p in kernel.params[len(args):]))
    except AttributeError:      # None (a compile hook took it) or not a compiled kernel
        return
    if len(_compiled) >= MAX_KEPT:   # (many distinct M: start again rather than grow)
        _compiled.clear()
        forget_ready()
    _compiled[key, device] = kept


def other_device(device_index: int) -> bool:
    """Whether CUDA device ``device_index`` is not the current one. Triton launches a kernel
    on the current device and its current stream, whatever device the arguments are on, so
    a launcher for tensors on another device (cuda:1 while cuda:0 is current) makes theirs
    current first. False for the CPU (-1)."""
    return device_index >= 0 and device_index != torch.cuda.current_device()


# ------------------------------------------------- occupancy, measured at a kernel's first launch

def device_limits(device_index: int) -> dict:
    """The model's hardware dict (:data:`normbook.bench.model.H200`) with what
    torch.cuda.get_device_properties tells of device ``device_index``: its SMs, registers,
    shared memory and threads per SM (the H200's values for what it does not tell)."""
    from normbook.bench.model import H200
    props = torch.cuda.get_device_properties(device_index)
    hw = dict(H200, sms=props.multi_processor_count)
    registers = getattr(props, "regs_per_multiprocessor", 0)
    shared = (getattr(props, "shared_memory_per_multiprocessor", 0)
              or getattr(props, "max_shared_memory_per_block_optin", 0)
              or getattr(props, "shared_memory_per_block_optin", 0))
    threads = getattr(props, "max_threads_per_multi_processor", 0)
    if registers:
        hw["registers"] = registers
    if shared:
        hw["shared"] = shared
    if threads:
        hw["warps"] = threads // 32
    return hw


def measure(kernel, plan, args: tuple, device_index: int) -> bool:
    """Programs per SM of ``plan``'s kernel as compiled for ``args`` on CUDA device
    ``device_index`` (the current one), from its registers, shared memory and warps
    (:func:`normbook.bench.model.programs_per_sm` with :func:`device_limits`): compiled
    without a launch (``kernel.warmup``, the binary loaded for its register count), recorded
    in ``_config.measured_per_sm`` for the plan builders, whose caches are cleared so that
    they rebuild their plans with it, marked measured. True when it differs from the plan's
    ``per_sm``: the plan's grid is wrong, rebuild it (too many programs of a cooperative grid
    and the driver refuses the launch; too few leave SMs idle)."""
    from normbook.kernels import _config, _take

    try:
        compiled = kernel.warmup(*args, grid=plan.grid, **plan.flags)
        if compiled is None:            # a compile hook took it: keep the assumption
            per_sm = plan.per_sm
        else:
            init = getattr(compiled, "_init_handles", None)
            if init is not None:        # n_regs is known once the binary is loaded
                init()
            from normbook.bench.model import programs_per_sm
            per_sm = max(1, programs_per_sm(compiled.n_regs, compiled.metadata.num_warps,
                                            compiled.metadata.shared, device_limits(device_index)))
    except Exception as e:  # noqa: BLE001 - a measurement must never stop the launch it sizes
        # (a Triton whose warmup or metadata differs from 3.6 / 3.9's): keep the assumption,
        # say so once; a compile error proper is raised again by the launch itself
        per_sm = plan.per_sm
        warnings.warn(f"normbook: could not read the compiled occupancy of {plan.kernel} "
                      f"({type(e).__name__}: {e}); its grid keeps {per_sm} programs per SM",
                      RuntimeWarning, stacklevel=3)
    _config.measured_per_sm[_config.measure_key(plan.kernel, plan.flags, device_index)] = per_sm
    _config.forward_plan.cache_clear()
    _config.backward_plan.cache_clear()
    if per_sm == plan.per_sm:
        return False
    _take._fits.cache_clear()       # which wide rows fit all their slices may change
    return True


# ----------------------------------------------------------------------------- the stub seam

class _StubUtils:
    """The driver utilities a compiled kernel needs to load, without a GPU."""

    def __init__(self):
        self.handles = itertools.count(1)

    def load_binary(self, name, kernel, shared, device):
        # (module, function, registers, spills, max threads): the handles stand in as ints,
        # one per loaded kernel, so that a launch shows which compiled variant it runs
        handle = next(self.handles)
        return handle, handle, 0, 0, 1024

    @staticmethod
    def get_device_properties(device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536,
                "warpSize": 32}

    @staticmethod
    def unload_module(module):
        pass


class _StubDriver:
    """Triton's CUDA driver for an sm_90 device 0 with stream 0, on a machine without one.
    A compiled kernel's launcher (Triton's ``CudaLauncher``, whose construction needs the CUDA
    driver library) is the C function ``"".format``, which takes any arguments and does
    nothing without entering Python, or a recorder of its arguments."""

    def __init__(self, record: Optional[list]):
        from triton.backends.compiler import GPUTarget

        self.utils = _StubUtils()
        launcher = "".format if record is None else (lambda *a: record.append(a))
        self.launcher_cls = lambda src, metadata: launcher
        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self):
        return self.target

    @staticmethod
    def get_current_device():
        return 0

    @staticmethod
    def get_current_stream(device):
        return 0

    @staticmethod
    def set_current_device(device):
        pass

    @staticmethod
    def get_device_capability(device):
        return 9, 0

    def __getattr__(self, name):
        raise AttributeError(f"normbook's stub Triton driver has no {name!r}: only launches "
                             "are stubbed (normbook.kernels._launch.stub_driver)")


@contextlib.contextmanager
def stub_driver(record: Optional[list] = None) -> Iterator[None]:
    """Run Triton's compiled-kernel path without a GPU for the duration: kernels compile for
    sm_90 (device 0, stream 0), load as stand-in handles, and every launch runs Triton's
    binding, specialization and lookup (or :func:`launch`'s) down to the compiled kernel's
    launcher, which does nothing, or appends its arguments to ``record``. Only with Triton's
    interpreter off (TRITON_INTERPRET unset before triton was imported); tensors may be CPU
    tensors (no kernel reads them). The kept compiled kernels are forgotten on entry and on
    exit, as are Triton's own for device 0."""
    stub = _StubDriver(record)
    previous = _drivers._active
    _forget()
    _drivers.set_active(stub)
    try:
        yield
    finally:
        _forget()           # (the stand-in handles are unloaded by the stub, not a driver)
        _drivers._active = previous


def _forget() -> None:
    """Drop the kept kernels, and Triton's compiled ones of normbook's kernels (whose
    per-device caches would otherwise hand a stub's kernels to a real device 0, or the
    reverse)."""
    from normbook.kernels import _backward, _forward

    _compiled.clear()
    forget_ready()
    for module in (_forward, _backward):
        for value in vars(module).values():
            caches = getattr(value, "device_caches", None)
            if caches is not None and not isinstance(value, InterpretedFunction):
                caches.clear()
