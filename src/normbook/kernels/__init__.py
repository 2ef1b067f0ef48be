"""Fused Triton kernels for LayerNorm and RMSNorm, chapter "Kernels".

Public functions (same signatures as ``torch.nn.functional``; always the Triton kernels:
compiled on CUDA, interpreted on the CPU when TRITON_INTERPRET=1 was set before triton was
imported, a clear error otherwise; under ``torch.jit.trace``, which records torch's ops and not
a kernel launch, the same equations in torch ops):

- :func:`layer_norm`, :func:`rms_norm`;
- :func:`add_layer_norm`, :func:`add_rms_norm`: the residual add fused in front, -> (y, h).

Each is :func:`normbook.layer_norm` (and its kin) with the kernel backend forced: the same
front door, validating once, and the same autograd Function
(``normbook.functional.NormFunction``). In eager mode it calls the launchers directly, which
launch each compiled kernel directly after its first launch (``_launch``; host time per call:
``python -m normbook.bench host``); under ``torch.compile`` and for
a DTensor it calls them through the custom ops ``torch.ops.normbook.norm_forward`` and
``norm_backward``, which torch.compile(fullgraph=True) traces through. Kernels compile under
Triton 3.6 and 3.9 with no spill (``make test``: every configuration of the compile report
under 3.6, sm_90's bf16 ones under 3.9 in the appendix), and did under 3.7.1 too, checked once
(2026-12-07); under 3.8.0 the sharing backward of LayerNorm with the residual's gradient
spills 82-94 bytes on sm_90.

Modules, one topic each: ``_forward`` and ``_backward`` (kernels and launchers), ``_config``
(from D, dtype and device to a plan: the kernel, its block shape, grid and launch options),
``_take`` (which rows the kernels take), ``_launch`` (the compiled kernels kept and launched
directly; the occupancy measured at a first launch; the stub driver), ``ops`` (these
public functions; the custom ops themselves are defined in ``normbook._ops``, without
Triton, so that an exported program loads after ``import normbook``), ``report``
(``python -m normbook.kernels.report``: the static compile report; its command line,
``normbook-report``, is ``normbook._report_cli``, outside this package, so that its --help
and its refusals need no Triton).
"""

try:
    import triton  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the platform
    # name: the module whose import failed, this one; with it ``python -m
    # normbook.kernels.report`` says this in one line (runpy's) instead of a traceback
    raise ImportError(
        "normbook.kernels needs Triton (Linux: pip install 'normbook[kernels]'); "
        "normbook.layer_norm and normbook.rms_norm work without it", name=__name__
    ) from e

from normbook.kernels.ops import add_layer_norm, add_rms_norm, layer_norm, rms_norm

__all__ = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"]
