// The C++ half of cachalot's PyTorch plug-in (the Rust half is python/src/ffi.rs).
//
// PyTorch's CUDAPluggableAllocator does not check what the allocation function returns: a
// failure must be a C++ exception, as PyTorch's own allocator throws one from the same place.
// Rust cannot throw one, so it calls cachalot_throw_runtime_error, which PyTorch's Python
// bindings turn into a RuntimeError carrying the message. And the graph-capture hook takes a
// std::pair and a std::function by value, which only C++ can name.
//
// No PyTorch or CUDA header is needed: cudaStream_t is declared as the CUDA headers declare it.

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>

struct CUstream_st;
typedef CUstream_st* cudaStream_t;
// c10::cuda::MempoolId_t (c10/cuda/CUDAGraphsC10Utils.h): std::pair<CaptureId_t, CaptureId_t>,
// CaptureId_t being unsigned long long.
typedef std::pair<unsigned long long, unsigned long long> MempoolId_t;

extern "C" [[noreturn]] void cachalot_throw_runtime_error(const char* message) {
  throw std::runtime_error(std::string(message));
}

// PyTorch calls this (set_begin_allocate_to_pool) when a CUDA graph capture begins
// (torch.cuda.graph, CUDAGraph.capture_begin, make_graphed_callables, torch.compile's
// "reduce-overhead" mode), before the capture starts. The plug-in cannot serve a capture: the
// policy queries events before allocations, which a capture forbids, and blocks a graph uses
// must stay out of the ordinary pools for the graph's lifetime (PyTorch's private graph pools).
// So the capture is refused here, with a message, instead of failing later and obscurely.
void cachalot_torch_begin_allocate_to_pool(int device, MempoolId_t pool,
                                           std::function<bool(cudaStream_t)> filter) {
  (void)pool;
  (void)filter;
  throw std::runtime_error(
      "cachalot: CUDA graph capture is not supported by the cachalot plug-in (device " +
      std::to_string(device) +
      "): torch.cuda.graph, make_graphed_callables and torch.compile(mode=\"reduce-overhead\") "
      "need PyTorch's own allocator. Run without cachalot.torch.install() for graphed code.");
}

extern "C" const void* cachalot_begin_allocate_to_pool_address() {
  return reinterpret_cast<const void*>(&cachalot_torch_begin_allocate_to_pool);
}
