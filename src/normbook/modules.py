"""``normbook.LayerNorm`` and ``normbook.RMSNorm``: torch.nn's modules, computed by normbook.

They subclass ``torch.nn.LayerNorm`` and ``torch.nn.RMSNorm``, so the constructor arguments,
the parameters (weight initialised to 1, bias to 0), the ``state_dict`` keys and the repr are
torch's own: a state_dict loads into either class and back. Only ``forward`` changes; under
``torch.jit.script`` it is torch's function, since TorchScript cannot compile Python's
dispatch to the Triton kernels.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import Tensor

from normbook.functional import (_HALF, _NO_BIAS, _module_norm, _rms_eps, _validate, layer_norm,
                                 rms_norm)

__all__ = ["LayerNorm", "RMSNorm"]

# The modules read their parameters from ``self._parameters``: ``self.weight`` misses the
# instance's dict and falls to ``Module.__getattr__``, a Python function, 0.4 us a read here,
# more than a tenth of the host time of a small forward (torch's own modules pay it too). A name
# that is not there (moved out by ``torch.nn.utils.parametrize``, say, or replaced by a plain
# tensor by a hook) comes back as _ABSENT and is read the usual way, so that forward sees what
# ``self.weight`` gives.
_ABSENT: Any = object()


def _replicate(self):
    """A DataParallel replica, without the calls this module keeps (functional._module_norm):
    a replica's parameters are on another device, and a store shared with it would be
    rebuilt at every call (copies and pickles of a module carry none: functional._Calls)."""
    replica = torch.nn.Module._replicate_for_data_parallel(self)
    replica.__dict__.pop("_normbook_calls", None)
    return replica


def _get_variance_epsilon(self) -> Any:
    return self.eps


def _set_variance_epsilon(self, value: Any) -> None:
    self.eps = value


# both modules' ``variance_epsilon``
_VARIANCE_EPSILON = property(_get_variance_epsilon, _set_variance_epsilon, doc="""\
``eps`` under Hugging Face's name, read and written as ``eps``: a norm that
:func:`normbook.swap_norms` or :func:`normbook.patch_hf` put in place of a Hugging Face one is
changed by code that sets ``variance_epsilon`` (it kept a copy of its own, which a write left
behind ``eps``).""")


class LayerNorm(torch.nn.LayerNorm):
    """LayerNorm module, equations (ln-mean) to (ln-y); see :func:`normbook.layer_norm`.

    Args (as ``torch.nn.LayerNorm``): normalized_shape, eps=1e-5, elementwise_affine=True,
    bias=True, device=None, dtype=None; and, keyword only, normbook's ``upcast``: True (half
    rows normalized as a float32 copy by torch's kernel, as OLMo's, CLIP's and Whisper's
    LayerNorms do) or ``"ops"`` (the equations as separate torch ops over a float32 copy, as
    Cohere's does), as :func:`normbook.layer_norm` takes it.

    Shape: input ``(*, *normalized_shape)`` -> output of the same shape.
    """

    # (a class attribute, so that a torch.nn.LayerNorm whose class a swap changed has it too;
    # a type comment, not an annotation: TorchScript reads the class's annotations)
    _upcast = False  # type: Union[bool, str]
    _replicate_for_data_parallel = _replicate
    variance_epsilon = _VARIANCE_EPSILON
    __jit_unused_properties__ = ["variance_epsilon"]    # (TorchScript compiles properties)

    def __init__(self, normalized_shape: Union[int, list[int], torch.Size], eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, device: Any = None,
                 dtype: Optional[torch.dtype] = None, *,
                 upcast: Union[bool, str] = False) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        _validate.check_upcast(upcast)
        if upcast is not False:
            self._upcast = upcast

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", upcast={self._upcast!r}" if self._upcast else "")

    def __prepare_scriptable__(self):
        if self._upcast:
            raise TypeError("torch.jit.script: a LayerNorm with upcast has no TorchScript "
                            "forward (torch's layer_norm has no upcast)")
        return self

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():   # TorchScript compiles torch's own function instead
            return torch.nn.functional.layer_norm(input, self.normalized_shape, self.weight,
                                                  self.bias, self.eps)
        params = self._parameters          # not self.weight: see _ABSENT
        weight, bias = params.get("weight", _ABSENT), params.get("bias", _ABSENT)
        if weight is _ABSENT or bias is _ABSENT:
            weight, bias = self.weight, self.bias
        eps = self.eps
        if self._upcast:
            return layer_norm(input, self.normalized_shape, weight, bias, eps,
                              upcast=self._upcast)
        if type(input) is not Tensor or input.is_nested:   # a subclass (DTensor, jagged),
            # or a strided nested tensor: the public door
            return layer_norm(input, self.normalized_shape, weight, bias, eps)
        return _module_norm(self, input, weight, bias,
                            eps if type(eps) is float else _validate.as_eps(eps), False)


class RMSNorm(torch.nn.RMSNorm):
    """RMSNorm module, equations (rms-ms) and (rms-y); see :func:`normbook.rms_norm`.

    Args (as ``torch.nn.RMSNorm``): normalized_shape, eps=None, elementwise_affine=True,
    device=None, dtype=None; and, keyword only, normbook's ``offset`` (gamma = offset +
    weight in float32: Gemma's 1 + weight; a ValueError with ``elementwise_affine=False``)
    and ``round_xhat`` (xhat rounded to the input's
    dtype before the weight multiplies: Llama's order in bf16 and fp16), as
    :func:`normbook.rms_norm` takes them. The weight is initialised to 1 as torch's, by the
    constructor and by ``reset_parameters()``, whatever the offset: with ``offset=1.0`` that is
    gamma = 2, every row doubled, not the identity. The identity with offset 1 is weight 0 (as
    Gemma initialises its norms and stores them in checkpoints): set it with
    ``torch.nn.init.zeros_(norm.weight)``.

    Shape: input ``(*, *normalized_shape)`` -> output of the same shape.
    """

    # (offset, round_xhat) when either is not the default, else None: one attribute the
    # forward reads (a class attribute, so that a torch.nn.RMSNorm whose class a swap changed
    # has it too)
    # (no annotation: TorchScript reads the class's annotations; mypy reads the comment)
    _modes = None  # type: Optional[tuple[float, bool]]
    _replicate_for_data_parallel = _replicate
    variance_epsilon = _VARIANCE_EPSILON
    __jit_unused_properties__ = ["variance_epsilon"]    # (TorchScript compiles properties)

    def __init__(self, normalized_shape: Union[int, list[int], torch.Size],
                 eps: Optional[float] = None,
                 elementwise_affine: bool = True, device: Any = None,
                 dtype: Optional[torch.dtype] = None, *, offset: float = 0.0,
                 round_xhat: bool = False) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.set_modes(offset, round_xhat)

    def set_modes(self, offset: float = 0.0, round_xhat: bool = False) -> None:
        """Set ``offset`` and ``round_xhat`` (see the class docstring)."""
        offset = _validate.check_modes(offset, round_xhat, self.weight is not None,
                                       "elementwise_affine=False")
        self._modes = (offset, round_xhat) if (offset or round_xhat) else None

    def extra_repr(self) -> str:
        modes = self._modes
        if modes is None:
            return super().extra_repr()
        return f"{super().extra_repr()}, offset={modes[0]}, round_xhat={modes[1]}"

    def __prepare_scriptable__(self):
        if self._modes is not None:
            raise TypeError("torch.jit.script: an RMSNorm with offset or round_xhat has no "
                            "TorchScript forward (torch's rms_norm has neither)")
        return self

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():   # TorchScript compiles torch's own function instead
            return torch.nn.functional.rms_norm(input, self.normalized_shape, self.weight, self.eps)
        weight = self._parameters.get("weight", _ABSENT)   # not self.weight: see _ABSENT
        if weight is _ABSENT:
            weight = self.weight
        eps = self.eps
        modes = self._modes
        if modes is not None:
            if not modes[0] and type(input) is Tensor and input.dtype in _HALF:
                # Llama's order alone, on half rows: kept as the plain call is (below)
                return _module_norm(self, input, weight, _NO_BIAS,
                                    eps if type(eps) is float else _rms_eps(input, eps), True,
                                    True)
            return rms_norm(input, self.normalized_shape, weight, eps, offset=modes[0],
                            round_xhat=modes[1])
        if type(input) is not Tensor or input.is_nested:   # a subclass (DTensor, jagged),
            # or a strided nested tensor: the public door
            return rms_norm(input, self.normalized_shape, weight, eps)
        return _module_norm(self, input, weight, _NO_BIAS,
                            eps if type(eps) is float else _rms_eps(input, eps), True)
