"""Fused Triton kernels for LayerNorm and RMSNorm, chapter "Kernels".

Public functions (same signatures as ``torch.nn.functional``; always the Triton kernels:
compiled on CUDA, interpreted on the CPU when TRITON_INTERPRET=1 was set before triton was
imported, a clear error otherwise):

- :func:`layer_norm`, :func:`rms_norm`;
- :func:`add_layer_norm`, :func:`add_rms_norm`: the residual add fused in front, -> (y, h).

All are autograd-capable. In eager mode they call an ``autograd.Function`` directly (host cost
near torch's own, see ``python -m normbook.bench host``); under ``torch.compile`` they are the
custom ops ``torch.ops.normbook.norm_forward`` and ``norm_backward``, so
``torch.compile(fullgraph=True)`` traces through them. Kernels compile under Triton 3.6 and 3.9.

Modules, one topic each: ``_forward`` and ``_backward`` (kernels and launchers), ``_config``
(block sizes, rows per program, persistent grid, cached launch options), ``ops`` (the
Function, the custom ops, argument checks, public functions), ``report``
(``python -m normbook.kernels.report``: the static compile report).
"""

try:
    import triton  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the platform
    raise ImportError(
        "normbook.kernels needs Triton (Linux: pip install 'normbook[kernels]'); "
        "normbook.layer_norm and normbook.rms_norm work without it"
    ) from e

from normbook.kernels.ops import add_layer_norm, add_rms_norm, layer_norm, rms_norm

__all__ = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"]
