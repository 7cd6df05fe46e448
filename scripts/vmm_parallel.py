#!/usr/bin/env python3
"""Does the CUDA driver make 2 MiB pages faster from several host threads at once?

Times creating, mapping and giving access to N pages of 2 MiB (each its own handle, as
expandable segments' map steps do) from 1, 2, 4, 8 and 16 threads, each thread taking a
contiguous share of the pages (its own cuMemCreate + cuMemMap per page, one cuMemSetAccess over
its share), and unmapping + releasing them the same way. ctypes releases the GIL around each
driver call, so threads overlap inside the driver if the driver lets them.

Usage: python3 scripts/vmm_parallel.py [--pages N] [--json OUT.json]
"""

import argparse
import ctypes
import threading
import time

from vmm_ctypes import MIB, report, setup


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch, cu, prop, access = setup()
    ctx = ctypes.c_void_p()
    cu.cuCtxGetCurrent(ctypes.byref(ctx))
    u64 = ctypes.c_uint64
    sz = ctypes.c_size_t
    page = 2 * MIB
    n = args.pages
    base = u64()
    assert cu.cuMemAddressReserve(ctypes.byref(base), sz(n * page), sz(0), u64(0), u64(0)) == 0
    handles = [u64() for _ in range(n)]
    errors = []

    def grow(lo, hi):
        cu.cuCtxSetCurrent(ctx)
        for i in range(lo, hi):
            r = cu.cuMemCreate(ctypes.byref(handles[i]), sz(page), ctypes.byref(prop), u64(0))
            r = r or cu.cuMemMap(u64(base.value + i * page), sz(page), sz(0), handles[i], u64(0))
            if r:
                errors.append(r)
                return
        r = cu.cuMemSetAccess(u64(base.value + lo * page), sz((hi - lo) * page),
                              ctypes.byref(access), sz(1))
        if r:
            errors.append(r)

    def shrink(lo, hi):
        cu.cuCtxSetCurrent(ctx)
        for i in range(lo, hi):
            r = cu.cuMemUnmap(u64(base.value + i * page), sz(page)) or cu.cuMemRelease(handles[i])
            if r:
                errors.append(r)
                return

    out = {"pages": n, "page_mib": 2}
    for threads in (1, 2, 4, 8, 16):
        row = {}
        for name, fn in (("grow", grow), ("shrink", shrink)):
            share = n // threads
            ts = [threading.Thread(target=fn, args=(t * share, (t + 1) * share))
                  for t in range(threads)]
            s = time.perf_counter_ns()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            e = time.perf_counter_ns()
            row[name + "_us_per_page"] = (e - s) / 1000 / n
        out[f"threads_{threads}"] = row
        if errors:
            out["errors"] = errors
            break
    assert cu.cuMemAddressFree(base, sz(n * page)) == 0
    report(out, torch, args.json)


if __name__ == "__main__":
    main()
