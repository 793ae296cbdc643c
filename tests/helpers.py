"""What the tests of both front ends share: device choice, plus the input makers and conversions of
`xkern.testing` with this machine's device as the default."""

from __future__ import annotations

import torch

from xkern.testing import rand, same_bits, to_numpy  # noqa: F401  (re-exported for the test files)
from xkern.testing import to_torch as _to_torch

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def to_torch(a, device: str = DEVICE) -> torch.Tensor:
    """numpy (ml_dtypes bfloat16 included) -> torch, bit for bit, on this machine's device by default."""
    return _to_torch(a, device)
