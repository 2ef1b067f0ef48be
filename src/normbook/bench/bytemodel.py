"""The byte model: how many bytes each (op, mode) must move through HBM.

Equations (kern-bytes-fwd) and (kern-bytes-bwd) of the chapter "Kernels".

A norm does O(D) work on O(D) bytes per row, so it is memory-bound and its speed is best
reported as bytes moved over time (GB/s), next to the copy bandwidth of the same device.
The byte count is a property of the *op*, not of the implementation: every provider is
charged the same bytes, namely what a fused kernel must move at the least, so GB/s compares
providers fairly (an implementation that moves more bytes simply shows a lower GB/s).

Each (op, mode) is declared as data below: a list of tensors, each with its shape in the
letters M (rows) and D (normalized size), its element size (the activation dtype ``e`` or
fp32 for the statistics) and whether it is read or written. The small terms are counted,
honestly, because they are real traffic:

- weight (gamma) and bias (beta), (D,) in the activation dtype, read once per pass (the
  kernel re-reads them per program, but from L2: HBM sees them about once);
- the statistics saved by forward for backward, fp32 (M,): mean and rstd for LayerNorm,
  rstd only for RMSNorm;
- the final dweight and dbias, (D,) in the activation dtype, written once.

Not counted: the per-program fp32 partial sums of dweight/dbias that a backward kernel
writes and then reduces. Their size depends on the implementation (grid size), not on the
op; leaving them out makes the model a lower bound on traffic, so the GB/s of a backward
that uses them is, if anything, understated.

Fused add (``add_layer_norm``, ``add_rms_norm``): h = x + residual, y = norm(h), both returned.
Forward reads x and residual, writes y and h. Backward reads dy, dh (the gradient that
flows into h from the rest of the network, as in a pre-norm residual stream) and h (saved
for the norm's backward), and writes dx once: the gradient of x and of residual is the
same tensor, dh + d(norm)/dh, so it is counted once.

``fwd_bwd`` is the sum of ``fwd`` and ``bwd``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "OPS", "MODES", "DTYPES", "Tensor", "TRAFFIC", "traffic", "bytes_moved", "itemsize",
]

OPS = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")
MODES = ("fwd", "bwd", "fwd_bwd")
DTYPES = ("bf16", "fp16", "fp32")

_ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name ("bf16", "fp16", "fp32", "fp64")."""
    try:
        return _ITEMSIZE[dtype]
    except KeyError:
        raise ValueError(f"dtype: expected one of {sorted(_ITEMSIZE)}, got {dtype!r}") from None


@dataclass(frozen=True)
class Tensor:
    """One tensor that crosses HBM: ``name``, shape ``rows x cols`` and access.

    rows is "M" or 1; cols is "D" or 1; ``fp32`` marks a statistic kept in fp32 whatever the
    activation dtype; ``access`` is "read" or "write".
    """

    name: str
    rows: str   # "M" or "1"
    cols: str   # "D" or "1"
    access: str  # "read" or "write"
    fp32: bool = False

    def nbytes(self, M: int, D: int, e: int) -> int:
        n = (M if self.rows == "M" else 1) * (D if self.cols == "D" else 1)
        return n * (4 if self.fp32 else e)


def _R(name, rows="M", cols="D", fp32=False):
    return Tensor(name, rows, cols, "read", fp32)


def _W(name, rows="M", cols="D", fp32=False):
    return Tensor(name, rows, cols, "write", fp32)


# The model, as data. Rows x cols: "M" x "D" is a full activation, "1" x "D" a parameter,
# "M" x "1" a per-row fp32 statistic.
_STATS = {"ln": [_W("mean", cols="1", fp32=True), _W("rstd", cols="1", fp32=True)],
          "rms": [_W("rstd", cols="1", fp32=True)]}
_STATS_READ = {k: [_R(t.name, cols="1", fp32=True) for t in v] for k, v in _STATS.items()}
_PARAMS = {"ln": [_R("weight", rows="1"), _R("bias", rows="1")], "rms": [_R("weight", rows="1")]}
_DPARAMS = {"ln": [_W("dweight", rows="1"), _W("dbias", rows="1")], "rms": [_W("dweight", rows="1")]}

#: The byte model as data. Maps (op, mode) to the tensors read and written, with shapes and dtypes.
TRAFFIC: dict[tuple[str, str], list[Tensor]] = {}
for _op, _k in (("layer_norm", "ln"), ("rms_norm", "rms")):
    # forward: read x, write y (+ params, + fp32 stats for backward)
    TRAFFIC[_op, "fwd"] = [_R("x"), *_PARAMS[_k], _W("y"), *_STATS[_k]]
    # backward: read x and dy, write dx (+ weight, stats, final dweight/dbias)
    TRAFFIC[_op, "bwd"] = [_R("x"), _R("dy"), _R("weight", rows="1"), *_STATS_READ[_k],
                           _W("dx"), *_DPARAMS[_k]]
    # fused add: h = x + residual; y = norm(h); both returned
    TRAFFIC["add_" + _op, "fwd"] = [_R("x"), _R("residual"), *_PARAMS[_k],
                                    _W("y"), _W("h"), *_STATS[_k]]
    # dx is also dresidual (the same tensor): written once
    TRAFFIC["add_" + _op, "bwd"] = [_R("h"), _R("dy"), _R("dh"), _R("weight", rows="1"),
                                    *_STATS_READ[_k], _W("dx"), *_DPARAMS[_k]]
for _op in OPS:
    TRAFFIC[_op, "fwd_bwd"] = TRAFFIC[_op, "fwd"] + TRAFFIC[_op, "bwd"]


def traffic(op: str, mode: str) -> list[Tensor]:
    """The tensors that (op, mode) reads and writes, as declared in :data:`TRAFFIC`."""
    if op not in OPS:
        raise ValueError(f"op: expected one of {OPS}, got {op!r}")
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    return TRAFFIC[op, mode]


def bytes_moved(op: str, mode: str, M: int, D: int, dtype: str) -> int:
    """Bytes that (op, mode) moves for an (M, D) input of ``dtype``, under the model above.

    Example: layer_norm forward, bf16, M = 32768, D = 4096 reads x and writes y
    (2 * M * D * 2 bytes), reads weight and bias (2 * D * 2) and writes mean and rstd
    (2 * M * 4): 537,149,440 bytes.
    """
    if M < 1 or D < 1:
        raise ValueError(f"M, D: expected positive sizes, got M={M}, D={D}")
    e = itemsize(dtype)
    return sum(t.nbytes(M, D, e) for t in traffic(op, mode))
