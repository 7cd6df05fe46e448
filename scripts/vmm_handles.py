#!/usr/bin/env python3
"""Facts about multi-page CUDA handles that rule 19j (one handle per map step) relies on,
measured on this GPU through ctypes on libcuda (PyTorch only makes the context current):

1. a sub-range of a large handle can be mapped at a second address (cuMemMap with an offset),
   and the two mappings alias (a byte written through one is read through the other);
2. whether cuMemUnmap accepts a sub-range of one mapping (CUDA's documentation says no);
3. whether one cuMemUnmap may cover two adjacent mappings of two handles;
4. the price of create + map + set access, and of unmap + release, per handle, by handle size.

Usage: python3 scripts/vmm_handles.py [--json OUT.json]
"""

import argparse
import ctypes
import time

from vmm_ctypes import MIB, check, report, setup


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--repeat", type=int, default=16)
    args = ap.parse_args()
    torch, cu, prop, access = setup()
    u64 = ctypes.c_uint64
    sz = ctypes.c_size_t

    def create(nbytes):
        h = u64()
        check(cu.cuMemCreate(ctypes.byref(h), sz(nbytes), ctypes.byref(prop), u64(0)), "create")
        return h

    def mapped(addr, nbytes, offset, h):
        check(cu.cuMemMap(u64(addr), sz(nbytes), sz(offset), h, u64(0)), "map")
        check(cu.cuMemSetAccess(u64(addr), sz(nbytes), ctypes.byref(access), sz(1)), "access")

    out = {}
    base = u64()
    check(cu.cuMemAddressReserve(ctypes.byref(base), sz(1024 * MIB), sz(0), u64(0), u64(0)),
          "reserve")
    a = base.value
    view = a + 512 * MIB
    # 1. A 64 MiB handle at home, its slot at offset 10 MiB mapped again at the view.
    h = create(64 * MIB)
    mapped(a, 64 * MIB, 0, h)
    r = cu.cuMemMap(u64(view), sz(2 * MIB), sz(10 * MIB), h, u64(0))
    out["map_with_offset_result"] = r
    if r == 0:
        check(cu.cuMemSetAccess(u64(view), sz(2 * MIB), ctypes.byref(access), sz(1)), "access")
        check(cu.cuMemsetD8_v2(u64(a + 10 * MIB + 4096), ctypes.c_ubyte(0xAB), sz(1)), "memset")
        check(cu.cuMemsetD8_v2(u64(a + 9 * MIB), ctypes.c_ubyte(0x11), sz(1)), "memset")
        check(cu.cuCtxSynchronize(), "sync")
        buf = (ctypes.c_ubyte * 1)()
        check(cu.cuMemcpyDtoH_v2(buf, u64(view + 4096), sz(1)), "copy")
        out["alias_reads_home_write"] = buf[0] == 0xAB
        # Write through the view, read at home.
        check(cu.cuMemsetD8_v2(u64(view + 100), ctypes.c_ubyte(0x5C), sz(1)), "memset")
        check(cu.cuCtxSynchronize(), "sync")
        check(cu.cuMemcpyDtoH_v2(buf, u64(a + 10 * MIB + 100), sz(1)), "copy")
        out["home_reads_alias_write"] = buf[0] == 0x5C
        # 2 MiB of the home below the slot must not be the view's.
        check(cu.cuMemcpyDtoH_v2(buf, u64(view - 0), sz(1)), "copy")
        out["alias_is_offset_not_start"] = buf[0] != 0x11
    # 2. Unmap a sub-range of the home mapping.
    out["unmap_subrange_result"] = cu.cuMemUnmap(u64(a + 10 * MIB), sz(2 * MIB))
    if out["unmap_subrange_result"] == 0:
        out["note_subrange"] = "driver accepted a sub-range unmap"
    if r == 0:
        check(cu.cuMemUnmap(u64(view), sz(2 * MIB)), "unmap view")
    cu.cuMemUnmap(u64(a), sz(64 * MIB))
    check(cu.cuMemRelease(h), "release")
    # 3. One unmap over two adjacent mappings of two handles.
    h1, h2 = create(4 * MIB), create(4 * MIB)
    mapped(a, 4 * MIB, 0, h1)
    mapped(a + 4 * MIB, 4 * MIB, 0, h2)
    out["unmap_two_mappings_result"] = cu.cuMemUnmap(u64(a), sz(8 * MIB))
    if out["unmap_two_mappings_result"] != 0:
        check(cu.cuMemUnmap(u64(a), sz(4 * MIB)), "unmap 1")
        check(cu.cuMemUnmap(u64(a + 4 * MIB), sz(4 * MIB)), "unmap 2")
    check(cu.cuMemRelease(h1), "release")
    check(cu.cuMemRelease(h2), "release")
    # 4. Price per handle by size.
    prices = {}
    for mib in (2, 8, 32, 128, 256):
        nbytes = mib * MIB
        grow, shrink = [], []
        for _ in range(args.repeat):
            s = time.perf_counter_ns()
            hh = create(nbytes)
            mapped(a, nbytes, 0, hh)
            e = time.perf_counter_ns()
            check(cu.cuMemUnmap(u64(a), sz(nbytes)), "unmap")
            check(cu.cuMemRelease(hh), "release")
            f = time.perf_counter_ns()
            grow.append((e - s) / 1000)
            shrink.append((f - e) / 1000)
        grow.sort()
        shrink.sort()
        prices[mib] = {"create_map_access_us_median": grow[len(grow) // 2],
                       "unmap_release_us_median": shrink[len(shrink) // 2]}
    out["per_handle"] = prices
    check(cu.cuMemAddressFree(u64(a), sz(1024 * MIB)), "free")
    report(out, torch, args.json)


if __name__ == "__main__":
    main()
