"""``Function``: torch.autograd.Function without a per-call cost that torch adds to the modern form.

When a Function defines ``setup_context`` (which torch.func transforms require), torch's
``Function.apply`` binds default arguments with ``inspect.signature`` on every call, about 12 us
on this project's machines: more than the rest of a small norm's host cost. normbook's Functions
are always called with every argument, positionally, so outside torch.func transforms ``apply``
goes straight to the C++ implementation; under a transform, torch's own path runs.
"""

from __future__ import annotations

import torch


class Function(torch.autograd.Function):
    """A torch.autograd.Function whose ``apply`` takes only complete positional arguments."""

    @classmethod
    def apply(cls, *args):
        if torch._C._are_functorch_transforms_active():
            return super().apply(*args)
        return super(torch.autograd.Function, cls).apply(*args)
