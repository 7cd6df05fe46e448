/* A stand-in for libcuda.so, for timing cachalot's buffer layer (`DeviceBuffer`) on a machine
 * without a GPU (allocator/benches/threads.rs, `pair_one_thread/*-buffer`). It knows one
 * device with 140 GiB, no virtual memory management (so cachalot's settings fall back to plain
 * segments, rule 21), and hands out made-up device addresses that nothing ever reads or
 * writes. Every call is counted: `fake_cuda_calls()` (and the line printed at exit) tells a
 * bench whether its timed loop reached the driver (a cache hit must not).
 *
 *   cc -O2 -shared -fPIC -o /tmp/fakecuda/libcuda.so allocator/benches/fake_driver/fake_cuda.c
 *   LD_LIBRARY_PATH=/tmp/fakecuda target/release/deps/threads-* --bench pair_one_thread
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef uint64_t CUdeviceptr;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;

static uint64_t calls, mem_allocs, mem_frees, streams_made, streams_destroyed;
static uint64_t next_address = 0x7f0000000000ull;
static uintptr_t next_handle = 0x1000;
static CUcontext current;
static char the_context;

uint64_t fake_cuda_calls(void) { return calls; }

static void report(void) __attribute__((destructor));
static void report(void) {
    if (getenv("FAKE_CUDA_VERBOSE"))
        fprintf(stderr, "fake libcuda: %llu calls; cuMemAlloc %llu, cuMemFree %llu; streams made %llu, destroyed %llu\n",
                (unsigned long long)calls, (unsigned long long)mem_allocs, (unsigned long long)mem_frees,
                (unsigned long long)streams_made, (unsigned long long)streams_destroyed);
}

#define C (++calls)
CUresult cuInit(unsigned flags) { (void)flags; C; return 0; }
CUresult cuDriverGetVersion(int *v) { C; *v = 12080; return 0; }
CUresult cuDeviceGetCount(int *n) { C; *n = 1; return 0; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) { C; if (ordinal != 0) return 101; *d = 0; return 0; }
CUresult cuDeviceGetName(char *name, int len, CUdevice d) { (void)d; C; strncpy(name, "fake device", len); return 0; }
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) { (void)d; C; *bytes = 140ull << 30; return 0; }
CUresult cuDeviceGetAttribute(int *v, int attrib, CUdevice d) {
    (void)d; C;
    switch (attrib) {
    case 102: /* VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */ *v = 0; break;
    case 115: /* MEMORY_POOLS_SUPPORTED */ *v = 0; break;
    case 75: case 76: /* compute capability */ *v = 9; break;
    default: *v = 1; break;
    }
    return 0;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice d) { (void)d; C; *ctx = &the_context; return 0; }
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { (void)d; C; return 0; }
CUresult cuCtxGetCurrent(CUcontext *ctx) { C; *ctx = current; return 0; }
CUresult cuCtxSetCurrent(CUcontext ctx) { C; current = ctx; return 0; }
CUresult cuCtxPushCurrent_v2(CUcontext ctx) { C; current = ctx; return 0; }
CUresult cuCtxPopCurrent_v2(CUcontext *ctx) { C; if (ctx) *ctx = current; return 0; }
CUresult cuCtxSynchronize(void) { C; return 0; }
CUresult cuCtxGetDevice(CUdevice *d) { C; *d = 0; return 0; }
CUresult cuStreamCreate(CUstream *s, unsigned flags) { (void)flags; C; ++streams_made; *s = (CUstream)(next_handle += 16); return 0; }
CUresult cuStreamCreateWithPriority(CUstream *s, unsigned flags, int p) { (void)flags; (void)p; C; ++streams_made; *s = (CUstream)(next_handle += 16); return 0; }
CUresult cuStreamDestroy_v2(CUstream s) { (void)s; C; ++streams_destroyed; return 0; }
CUresult cuStreamSynchronize(CUstream s) { (void)s; C; return 0; }
CUresult cuStreamQuery(CUstream s) { (void)s; C; return 0; }
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned f) { (void)s; (void)e; (void)f; C; return 0; }
CUresult cuStreamIsCapturing(CUstream s, int *status) { (void)s; C; *status = 0; return 0; }
CUresult cuStreamGetCtx(CUstream s, CUcontext *ctx) { (void)s; C; *ctx = &the_context; return 0; }
CUresult cuEventCreate(CUevent *e, unsigned flags) { (void)flags; C; *e = (CUevent)(next_handle += 16); return 0; }
CUresult cuEventDestroy_v2(CUevent e) { (void)e; C; return 0; }
CUresult cuEventRecord(CUevent e, CUstream s) { (void)e; (void)s; C; return 0; }
CUresult cuEventQuery(CUevent e) { (void)e; C; return 0; }
CUresult cuEventSynchronize(CUevent e) { (void)e; C; return 0; }
CUresult cuMemGetInfo_v2(size_t *free, size_t *total) { C; *total = 140ull << 30; *free = *total - (next_address - 0x7f0000000000ull); return 0; }
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes) {
    C;
    ++mem_allocs;
    *p = next_address;
    next_address += (bytes + (2u << 20) - 1) & ~(uint64_t)((2u << 20) - 1);
    return 0;
}
CUresult cuMemFree_v2(CUdeviceptr p) { (void)p; C; ++mem_frees; return 0; }
