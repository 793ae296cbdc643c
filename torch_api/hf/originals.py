"""What a module runs without xkern: the forward its class had before `patch_hf_classes`, and whether a
module's `forward` (or `extra_repr`) is still its class's. Every way in falls back to these, and the probe
reads a patched class as it was."""

from __future__ import annotations

import torch

# patched class -> its own `forward` (and, for a norm, `extra_repr`) before patching (None: inherited)
SAVED: dict[type, dict] = {}


def original_forward(cls: type):
    """The forward `cls` had before `patch_hf_classes`."""
    for c in cls.__mro__:
        if c in SAVED:
            if SAVED[c]["forward"] is not None:
                return SAVED[c]["forward"]
        elif "forward" in c.__dict__:
            return c.__dict__["forward"]
    raise TypeError(f"{cls.__name__} has no forward")


def is_unset(m: torch.nn.Module, name: str) -> bool:
    """No instance attribute `name`, or what a pickled patch loads as: the class's method bound to `m`."""
    f = m.__dict__.get(name)
    return f is None or (getattr(f, "__func__", None) is getattr(type(m), name) and getattr(f, "__self__", None) is m)
