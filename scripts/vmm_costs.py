#!/usr/bin/env python3
"""What each CUDA virtual-memory driver call costs on this GPU, per page: the calls behind
expandable segments' map steps and unmaps (cachalot's rule 19/20 backend and PyTorch's).

Times, over N pages of 2 MiB and of 20 MiB, each of: cuMemCreate, cuMemMap, cuMemSetAccess (one
page at a time, and once over the whole run of pages), cuMemUnmap, cuMemRelease, cuCtxSynchronize
with the GPU idle; and two ways of moving a page's memory to another address: unmap + release +
create + map + set access (what a backend that gives pages back does) against unmap + map of the
same physical handle + set access (remapping, which keeps the memory).

Runs through ctypes on libcuda in the context PyTorch made current (PyTorch is only used to
create it). Usage: python3 scripts/vmm_costs.py [--pages N] [--json OUT.json]
"""

import argparse
import ctypes
import json
import time

from vmm_ctypes import MIB, check, setup


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch, cu, prop, access = setup()
    u64 = ctypes.c_uint64
    results = {}
    for page_mib in (2, 20):
        page = page_mib * MIB
        n = args.pages
        base = u64()
        check(cu.cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(2 * n * page),
                                     ctypes.c_size_t(0), u64(0), u64(0)), "cuMemAddressReserve")
        addr = [base.value + i * page for i in range(n)]
        other = [base.value + (n + i) * page for i in range(n)]
        handles = [u64() for _ in range(n)]
        t = {}

        def timed(name, fn):
            s = time.perf_counter_ns()
            fn()
            t[name] = (time.perf_counter_ns() - s) / n / 1000.0  # µs per page

        timed("cuMemCreate", lambda: [check(cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(page),
                                                           ctypes.byref(prop), u64(0)), "cuMemCreate")
                                      for h in handles])
        timed("cuMemMap", lambda: [check(cu.cuMemMap(u64(a), ctypes.c_size_t(page), ctypes.c_size_t(0),
                                                     h, u64(0)), "cuMemMap")
                                   for a, h in zip(addr, handles)])
        timed("cuMemSetAccess per page", lambda: [check(cu.cuMemSetAccess(u64(a), ctypes.c_size_t(page),
                                                                          ctypes.byref(access), ctypes.c_size_t(1)),
                                                        "cuMemSetAccess") for a in addr])
        timed("cuMemSetAccess whole run", lambda: check(cu.cuMemSetAccess(u64(addr[0]), ctypes.c_size_t(n * page),
                                                                          ctypes.byref(access), ctypes.c_size_t(1)),
                                                        "cuMemSetAccess"))
        timed("cuCtxSynchronize (idle)", lambda: [check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
                                                  for _ in range(n)])
        # Remap: unmap each page and map the same handle at another address, then set access.
        def remap():
            for a, b, h in zip(addr, other, handles):
                check(cu.cuMemUnmap(u64(a), ctypes.c_size_t(page)), "cuMemUnmap")
                check(cu.cuMemMap(u64(b), ctypes.c_size_t(page), ctypes.c_size_t(0), h, u64(0)), "cuMemMap")
                check(cu.cuMemSetAccess(u64(b), ctypes.c_size_t(page), ctypes.byref(access),
                                        ctypes.c_size_t(1)), "cuMemSetAccess")
        timed("move by remapping (unmap + map + access)", remap)
        # Give back and make anew: unmap, release, create, map, access.
        def recreate():
            for i, (a, b) in enumerate(zip(other, addr)):
                check(cu.cuMemUnmap(u64(a), ctypes.c_size_t(page)), "cuMemUnmap")
                check(cu.cuMemRelease(handles[i]), "cuMemRelease")
                check(cu.cuMemCreate(ctypes.byref(handles[i]), ctypes.c_size_t(page), ctypes.byref(prop),
                                     u64(0)), "cuMemCreate")
                check(cu.cuMemMap(u64(b), ctypes.c_size_t(page), ctypes.c_size_t(0), handles[i], u64(0)),
                      "cuMemMap")
                check(cu.cuMemSetAccess(u64(b), ctypes.c_size_t(page), ctypes.byref(access),
                                        ctypes.c_size_t(1)), "cuMemSetAccess")
        timed("move by release + create (unmap + release + create + map + access)", recreate)
        timed("cuMemUnmap", lambda: [check(cu.cuMemUnmap(u64(a), ctypes.c_size_t(page)), "cuMemUnmap")
                                     for a in addr])
        timed("cuMemRelease", lambda: [check(cu.cuMemRelease(h), "cuMemRelease") for h in handles])
        check(cu.cuMemAddressFree(base, ctypes.c_size_t(2 * n * page)), "cuMemAddressFree")
        results[f"{page_mib} MiB pages"] = t
        print(f"{page_mib} MiB pages, {n} pages, µs per page:")
        for k, v in t.items():
            print(f"  {k:<70} {v:10.1f}")
    if args.json:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "pages": args.pages, "us_per_page": results}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
