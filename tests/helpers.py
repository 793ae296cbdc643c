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


def graph_ops(graph) -> list[str]:
    """The call_function targets of an FX graph, in order. On a GPU, AOT autograd decomposes a
    `torch.library.triton_op` into its Triton launches (`triton_kernel_wrapper_functional`); a launch of an
    xkern RMSNorm kernel is named as its op ("xkern.add_rms_norm_fwd.default" for `_add_rms_norm_fwd_row_kernel`),
    any other kernel "triton:<name>", so one assertion holds on both machines."""
    names = []
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        name = str(n.target)
        if "triton_kernel_wrapper" in name:
            from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

            kernel = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
            kname = getattr(kernel, "fn", kernel).__name__
            ops = ("add_rms_norm_fwd", "add_rms_norm_bwd", "rms_norm_fwd", "rms_norm_bwd")
            name = next((f"xkern.{op}.default" for op in ops if kname.startswith(f"_{op}")), f"triton:{kname}")
        names.append(name)
    return names
