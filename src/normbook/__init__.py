"""normbook: LayerNorm and RMSNorm, derived, checked and fused.

The package behind the normbook textbook. Public names mirror ``torch.nn.functional`` and
``torch.nn``; the derivation lives in :mod:`normbook.reference`, the invariance checks in
:mod:`normbook.checks`, the Triton kernels in :mod:`normbook.kernels` (imported only on demand:
``import normbook`` never imports triton).
"""

from normbook.functional import add_layer_norm, add_rms_norm, backend, layer_norm, rms_norm
from normbook.modules import LayerNorm, RMSNorm

__version__ = "0.1.0"

__all__ = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "LayerNorm", "RMSNorm", "backend",
           "__version__"]
