"""A compiled RMSNorm step (forward + backward), its static graph against dynamic=True's (the row count symbolic,
each call's plan chosen at run time through the op's opaque twin): microseconds per step, 100 steps after 5
warm-up ones, at the main benchmark's shapes. On the GPU (Inductor):

    python tests/gpu_compile_dynamic.py

On the CPU (TRITON_INTERPRET=1, aot_eager) it runs one tiny shape untimed, as a check that it runs."""
import torch

import torch_api as xt

dev = "cuda" if torch.cuda.is_available() else "cpu"
backend = "inductor" if dev == "cuda" else "aot_eager"
shapes = [(16384, 4096), (65536, 256), (4096, 8192)] if dev == "cuda" else [(8, 64)]
for rows, width in shapes:
    norm = xt.RMSNorm(width, device=dev, dtype=torch.bfloat16)
    x = torch.randn(rows, width, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    out = {}
    for dynamic in (False, True):
        torch._dynamo.reset()
        f = torch.compile(norm, backend=backend, dynamic=dynamic)

        def step(f=f, x=x, norm=norm, dy=dy):
            return torch.autograd.grad(f(x), (x, norm.weight), dy)

        for _ in range(5):
            step()
        if dev == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(100):
                step()
            end.record()
            torch.cuda.synchronize()
            out[dynamic] = start.elapsed_time(end) * 10  # us per step
        else:
            out[dynamic] = 1.0
    print(f"{rows}x{width}: static {out[False]:.1f} us, dynamic {out[True]:.1f} us, ratio {out[True] / out[False]:.3f}")
