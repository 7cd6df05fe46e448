"""The CUDA driver's virtual-memory structures through ctypes, for the scripts that time them
(vmm_costs.py, vmm_handles.py, vmm_parallel.py): the context PyTorch makes current, libcuda,
pinned-memory properties and read-write access for the current device."""

import ctypes
import json

MIB = 1 << 20


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", AllocFlags)]


class Access(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


def setup():
    """Makes PyTorch's CUDA context current; returns (torch, libcuda, prop, access): pinned
    memory on the current device, and read-write access for it."""
    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    cu = ctypes.CDLL("libcuda.so.1")
    dev = torch.cuda.current_device()
    prop = Prop()
    prop.type = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = 1  # CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = dev
    access = Access()
    access.location.type = 1
    access.location.id = dev
    access.flags = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return torch, cu, prop, access


def check(r, what):
    """Raises when a driver call did not return CUDA_SUCCESS."""
    if r != 0:
        raise RuntimeError(f"{what} failed: CUresult {r}")


def report(out, torch, path=None):
    """Names the GPU in `out`, prints it as JSON and writes it to `path` when given."""
    out["gpu"] = torch.cuda.get_device_name()
    print(json.dumps(out, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
