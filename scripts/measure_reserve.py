#!/usr/bin/env python3
"""Measure the device memory a PyTorch process holds outside its caching allocator: the CUDA
context and the libraries. `cachalot fit` adds it to the allocator's need (`--reserve`, default
from results/fit/reserve.json, which this script's output replaces).

On the GPU, in this fresh process:

  reserve_context_bytes    after torch.cuda.init() and a first tiny allocation:
                           mem_get_info() total - free - memory_reserved()
  reserve_libraries_bytes  the same after one matmul (cuBLAS) and one convolution forward and
                           backward (cuDNN) have loaded their libraries
  reserve_workload_bytes   the same after a small training step of a convolutional network
                           with batch norm, pooling, a linear layer, a loss and AdamW (the kernels
                           a training job loads; CUDA loads modules lazily)

`reserve` is the largest of the three. `memory_reserved()` is what the caching allocator holds
(its segments; cuBLAS and cuDNN workspaces come from it too), so what is left is the context,
the loaded modules and the libraries' own allocations. mem_get_info counts every process on the
device: run this alone on it.

Usage:  python3 scripts/measure_reserve.py --out FILE.json
(the file has the shape of results/fit/reserve.json; copy it there to make it the default)
"""

import argparse
import json
import time


def outside(torch):
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return int(total - free - torch.cuda.memory_reserved()), int(total), int(free)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import torch

    torch.cuda.init()
    x = torch.empty(1, device="cuda")
    ctx, total, free0 = outside(torch)

    a1 = torch.randn(1024, 1024, device="cuda")
    _ = a1 @ a1
    conv = torch.nn.Conv2d(3, 16, 3, padding=1).cuda()
    y = conv(torch.randn(8, 3, 64, 64, device="cuda", requires_grad=True))
    y.sum().backward()
    libs, _, _ = outside(torch)

    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10),
    ).cuda()
    opt = torch.optim.AdamW(net.parameters())
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(
            net(torch.randn(16, 3, 64, 64, device="cuda")),
            torch.randint(0, 10, (16,), device="cuda"),
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    work, _, _ = outside(torch)
    del x

    props = torch.cuda.get_device_properties(0)
    doc = {
        "reserve": max(ctx, libs, work),
        "provisional": False,
        "what": "device memory a PyTorch process holds outside its caching allocator on an "
        "NVIDIA H200: the CUDA context and the libraries (cuBLAS, cuDNN) a training job loads; "
        "the default of `cachalot fit --reserve`",
        "how": "scripts/measure_reserve.py: torch.cuda.mem_get_info() total - free, minus "
        "torch.cuda.memory_reserved(), after torch.cuda.init() and a first tiny allocation "
        "(reserve_context_bytes), after a matmul and a convolution (reserve_libraries_bytes), "
        "after a small AdamW training step of a conv net (reserve_workload_bytes); `reserve` is "
        "the largest",
        "note": "measured",
        "reserve_context_bytes": ctx,
        "reserve_libraries_bytes": libs,
        "reserve_workload_bytes": work,
        "gpu_name": props.name,
        "device_total_memory": total,
        "free_after_init_bytes": free0,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "measured_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
