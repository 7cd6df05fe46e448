#!/usr/bin/env python3
"""Replay a cachalot ops file through PyTorch's own CUDA caching allocator, timed in C++.

`cachalot replay TRACE --ops-out FILE` writes the operation program cachalot replays (format:
src/ops.rs, "cachalot ops v1"). This script runs the same program through
c10::cuda::CUDACachingAllocator on a real GPU, so that PyTorch's figures (max_memory_reserved,
max_memory_allocated, memory_stats(), device allocations, ns per operation) stand beside
cachalot's for exactly the same operations, under any PYTORCH_CUDA_ALLOC_CONF
(expandable_segments:True included).

How each line runs (C++ compiled with torch.utils.cpp_extension.load_inline; no Python per op):

  a ID SIZE STREAM  raw_alloc_with_stream(SIZE, stream): STREAM 0 is the legacy default stream,
                    every other trace stream handle gets a CUDA stream of its own
  f ID              raw_delete(ptr)
  r ID SIDE         side stream SIDE: a CUDA stream of its own, kept busy by a one-thread kernel
                    that spins on a flag in host-mapped memory; then recordStream(ptr, SIDE). The
                    free that follows records PyTorch's event behind the spinning kernel, so the
                    block stays held back (not reusable) until ...
  c SIDE            ... the flag is set and the side stream synchronised: the event is complete,
                    and PyTorch's next allocation (process_events) frees the block, as in the
                    recorded run when the trace reached free_completed
  e                 empty_cache(); PyTorch synchronises every outstanding event first, so the
                    spinning side streams are released (and synchronised) just before it
  s                 end of the start's set-up (live tensors of a mid-run recording)

A watchdog thread releases every spinning side stream if the replay makes no progress for
0.3 s while one is pending (PyTorch waiting for an event inside an allocation's out-of-memory
path); the run's JSON counts such releases (`forced_releases`, 0 when the program never made
PyTorch wait).

Timing: the first pass over the trace's lines (after `s`), and with --repeat N the mean of
passes 2..N, each after freeing every live handle in id order and completing every side stream
(no empty_cache: the allocator is warm), as `cachalot replay --repeat N` does. The time of the
side-stream mechanism itself (kernel launches, flag stores, stream synchronisations) is measured
and subtracted; ns_per_op divides by cachalot's operation count of one pass (`program_ops`, in
which a plain free is two operations), ns_per_line by the lines run.

Each replay runs in a fresh Python process (the allocator starts empty, the configuration is
read from PYTORCH_CUDA_ALLOC_CONF at its first use).

scripts/pytorch_bench.py (the side-by-side GPU benchmark, docs/GPU_BENCH.md) imports this module
and uses the same extension, with two functions of its own: run_observed (the trace's lines
once, getDeviceStats() read after every line) and hot_loop (raw alloc/delete pairs in threads).

Usage:
  python3 scripts/pytorch_replay.py OPS [--conf CONF] [--fraction F] [--repeat N]
                                         [--snapshot-out FILE.pickle] [--json-out FILE.json]
  python3 scripts/pytorch_replay.py --batch JOBS.json --out DIR [--repeat N]

JOBS.json is a list of objects {"name", "ops", "conf", "fraction", "config", "snapshot"} (conf
and fraction may be null; snapshot true dumps a snapshot with history of the first pass, as
_record_memory_history(enabled="all", context=None) records it); DIR/NAME.json gets each run's
figures, DIR/index.json the list.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

EXT_NAME = "cachalot_pytorch_replay_v2"

CPP_SOURCE = r"""
#include <pybind11/stl.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

void cachalot_launch_spin(cudaStream_t stream, volatile unsigned int* flag);

namespace {

namespace alloc = c10::cuda::CUDACachingAllocator;
using Clock = std::chrono::steady_clock;

enum Kind : uint8_t { ALLOC, FREE, RECORD, COMPLETE, EMPTY };
struct Op {
  Kind kind;
  uint64_t a;  // handle (a, f, r) or side stream (c)
  uint64_t b;  // size (a) or side stream (r)
  uint64_t c;  // stream (a)
};

constexpr int MAX_SLOTS = 4096;

struct Side {
  cudaStream_t stream = nullptr;
  int slot = -1;
};

struct State {
  std::vector<Op> start_ops, trace_ops;
  uint64_t handles = 0;
  uint64_t program_ops = 0;
  std::vector<void*> ptr;        // per handle, nullptr when not live
  std::vector<uint64_t> size;    // per handle
  std::unordered_map<uint64_t, cudaStream_t> streams;  // trace stream handle -> stream
  std::unordered_map<uint64_t, Side> pending;          // side stream id -> busy stream
  std::vector<Side> idle;                              // side streams free for reuse
  int next_slot = 0;
  unsigned int* flags_host = nullptr;
  unsigned int* flags_dev = nullptr;
  std::atomic<int> slot_active[MAX_SLOTS];
  c10::DeleterFnPtr deleter = nullptr;
  int device = 0;
  // counters
  uint64_t requested = 0, peak_requested = 0;
  uint64_t allocs = 0, ooms = 0, frees = 0, records = 0, completes = 0, empties = 0;
  uint64_t skipped = 0;
  double overhead_ns = 0;
  std::atomic<uint64_t> progress{0};
  std::atomic<bool> running{false};
  std::atomic<bool> in_run{false};
  std::atomic<uint64_t> forced{0};
  std::atomic<uint64_t> forced_outside{0};
  std::thread watchdog;
  bool count = true;  // count requested bytes and ops (first pass)
};

State* S = nullptr;

uint64_t parse_u64(const char*& p) {
  while (*p == ' ') ++p;
  char* end = nullptr;
  unsigned long long v = std::strtoull(p, &end, 10);
  if (end == p) throw std::runtime_error("ops file: a number was expected");
  p = end;
  return v;
}

void parse(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (!f) throw std::runtime_error("cannot open " + path);
  char line[512];
  bool in_trace = false;
  long lineno = 0;
  while (std::fgets(line, sizeof line, f)) {
    ++lineno;
    const char* p = line;
    if (*p == '#') {
      std::string l(line);
      auto num = [&](const char* key, uint64_t& out) {
        std::string k = std::string("# ") + key + ": ";
        if (l.rfind(k, 0) == 0) out = std::strtoull(l.c_str() + k.size(), nullptr, 10);
      };
      num("handles", S->handles);
      num("program_ops", S->program_ops);
      continue;
    }
    if (*p == '\n' || *p == 0) continue;
    char k = *p++;
    Op op{};
    switch (k) {
      case 'a': op.kind = ALLOC; op.a = parse_u64(p); op.b = parse_u64(p); op.c = parse_u64(p); break;
      case 'f': op.kind = FREE; op.a = parse_u64(p); break;
      case 'r': op.kind = RECORD; op.a = parse_u64(p); op.b = parse_u64(p); break;
      case 'c': op.kind = COMPLETE; op.a = parse_u64(p); break;
      case 'e': op.kind = EMPTY; break;
      case 's': in_trace = true; continue;
      default:
        std::fclose(f);
        throw std::runtime_error("ops file line " + std::to_string(lineno) + ": unknown operation");
    }
    if (op.kind == ALLOC && op.a + 1 > S->handles) S->handles = op.a + 1;
    (in_trace ? S->trace_ops : S->start_ops).push_back(op);
  }
  std::fclose(f);
  if (!in_trace) throw std::runtime_error("ops file: no `s` line (not a cachalot ops v1 file?)");
  for (auto* v : {&S->start_ops, &S->trace_ops})
    for (const Op& op : *v)
      if ((op.kind == ALLOC || op.kind == FREE || op.kind == RECORD) && op.a >= S->handles)
        throw std::runtime_error("ops file: handle " + std::to_string(op.a) + " beyond `handles`");
}

double ns_since(Clock::time_point t) {
  return std::chrono::duration<double, std::nano>(Clock::now() - t).count();
}

cudaStream_t trace_stream(uint64_t handle) {
  auto it = S->streams.find(handle);
  if (it != S->streams.end()) return it->second;
  cudaStream_t s = nullptr;
  if (handle != 0) C10_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  S->streams.emplace(handle, s);
  return s;
}

Side take_side() {
  if (!S->idle.empty()) {
    Side s = S->idle.back();
    S->idle.pop_back();
    return s;
  }
  if (S->next_slot >= MAX_SLOTS) throw std::runtime_error("too many side streams pending at once");
  Side s;
  C10_CUDA_CHECK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
  s.slot = S->next_slot++;
  return s;
}

void set_flag(int slot, unsigned int v) {
  __atomic_store_n(&S->flags_host[slot], v, __ATOMIC_SEQ_CST);
}

// Completes side stream `id` if a use is pending on it.
void complete_side(uint64_t id) {
  auto it = S->pending.find(id);
  if (it == S->pending.end()) return;
  Side s = it->second;
  S->pending.erase(it);
  set_flag(s.slot, 1);
  C10_CUDA_CHECK(cudaStreamSynchronize(s.stream));
  S->slot_active[s.slot].store(0);
  S->idle.push_back(s);
}

void complete_all() {
  std::vector<uint64_t> ids;
  for (auto& kv : S->pending) ids.push_back(kv.first);
  for (auto id : ids) complete_side(id);
}

void run_ops_inner(const std::vector<Op>& ops);

// The watchdog watches only while operations run (not while Python reads the figures).
void run_ops(const std::vector<Op>& ops) {
  S->in_run.store(true);
  try {
    run_ops_inner(ops);
  } catch (...) {
    S->in_run.store(false);
    throw;
  }
  S->in_run.store(false);
}

// One operation line (every mode runs its lines through here).
inline void run_op(const Op& op) {
  switch (op.kind) {
    case ALLOC: {
      cudaStream_t st = trace_stream(op.c);
      void* p = nullptr;
      try {
        p = alloc::raw_alloc_with_stream(op.b, st);
      } catch (const c10::OutOfMemoryError&) {
        p = nullptr;
        if (S->count) ++S->ooms;
      }
      if (S->count) ++S->allocs;
      S->ptr[op.a] = p;
      if (p) {
        S->size[op.a] = op.b;
        S->requested += op.b;
        if (S->count && S->requested > S->peak_requested) S->peak_requested = S->requested;
      }
      break;
    }
    case FREE: {
      void* p = S->ptr[op.a];
      if (!p) { ++S->skipped; break; }
      alloc::raw_delete(p);
      S->ptr[op.a] = nullptr;
      S->requested -= S->size[op.a];
      if (S->count) ++S->frees;
      break;
    }
    case RECORD: {
      void* p = S->ptr[op.a];
      if (!p) { ++S->skipped; break; }
      auto t = Clock::now();
      complete_side(op.b);  // a side stream id is used once at a time
      Side s = take_side();
      set_flag(s.slot, 0);
      S->slot_active[s.slot].store(1);
      cachalot_launch_spin(s.stream, S->flags_dev + s.slot);
      C10_CUDA_CHECK(cudaGetLastError());
      S->pending[op.b] = s;
      S->overhead_ns += ns_since(t);
      c10::DataPtr dp(p, nullptr, S->deleter, c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(S->device)));
      alloc::recordStream(dp, c10::cuda::getStreamFromExternal(s.stream, static_cast<c10::DeviceIndex>(S->device)));
      if (S->count) ++S->records;
      break;
    }
    case COMPLETE: {
      auto t = Clock::now();
      if (S->pending.count(op.a) && S->count) ++S->completes;
      complete_side(op.a);
      S->overhead_ns += ns_since(t);
      break;
    }
    case EMPTY: {
      auto t = Clock::now();
      complete_all();  // PyTorch waits for every outstanding event first
      S->overhead_ns += ns_since(t);
      alloc::emptyCache();
      if (S->count) ++S->empties;
      break;
    }
  }
  S->progress.fetch_add(1, std::memory_order_relaxed);
}

void run_ops_inner(const std::vector<Op>& ops) {
  for (const Op& op : ops) run_op(op);
}

void watchdog_loop() {
  uint64_t last = S->progress.load();
  int still = 0;
  while (S->running.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    uint64_t now = S->progress.load();
    bool any = false;
    for (int i = 0; i < S->next_slot; ++i) any |= S->slot_active[i].load() == 1;
    // Inside the operations, 0.3 s without progress is PyTorch waiting for an event (its
    // out-of-memory path); outside them, a device-wide synchronisation from Python (3 s).
    bool in_run = S->in_run.load();
    if (now == last && any) {
      if (++still >= (in_run ? 3 : 30)) {
        // Released slots are marked 2 until their `c` line (or the end) completes them.
        for (int i = 0; i < S->next_slot; ++i) {
          int one = 1;
          if (S->slot_active[i].compare_exchange_strong(one, 2)) set_flag(i, 1);
        }
        (in_run ? S->forced : S->forced_outside).fetch_add(1);
        still = 0;
      }
    } else {
      still = 0;
    }
    last = now;
  }
}

}  // namespace

// Reads the ops file and sets up streams, flags and the watchdog. Returns counts.
std::map<std::string, double> prepare(const std::string& path) {
  if (S) throw std::runtime_error("prepare() twice");
  S = new State();
  for (auto& a : S->slot_active) a.store(0);
  parse(path);
  S->ptr.assign(S->handles, nullptr);
  S->size.assign(S->handles, 0);
  C10_CUDA_CHECK(cudaGetDevice(&S->device));
  S->deleter = alloc::get()->raw_deleter();
  if (!S->deleter) throw std::runtime_error("the CUDA allocator has no raw deleter");
  C10_CUDA_CHECK(cudaHostAlloc((void**)&S->flags_host, MAX_SLOTS * sizeof(unsigned int), cudaHostAllocMapped));
  for (int i = 0; i < MAX_SLOTS; ++i) S->flags_host[i] = 1;
  C10_CUDA_CHECK(cudaHostGetDevicePointer((void**)&S->flags_dev, S->flags_host, 0));
  // Warm up the kernel (module loading) and create the trace's streams outside the timing.
  {
    cudaStream_t s;
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cachalot_launch_spin(s, S->flags_dev);
    C10_CUDA_CHECK(cudaGetLastError());
    C10_CUDA_CHECK(cudaStreamSynchronize(s));
    C10_CUDA_CHECK(cudaStreamDestroy(s));
  }
  for (auto* v : {&S->start_ops, &S->trace_ops})
    for (const Op& op : *v)
      if (op.kind == ALLOC) trace_stream(op.c);
  S->running.store(true);
  S->watchdog = std::thread(watchdog_loop);
  std::map<std::string, double> out;
  out["handles"] = (double)S->handles;
  out["program_ops"] = (double)S->program_ops;
  out["start_lines"] = (double)S->start_ops.size();
  out["trace_lines"] = (double)S->trace_ops.size();
  out["trace_streams"] = (double)S->streams.size();
  return out;
}

// Runs the start's lines (before `s`). Returns ns (allocator time).
double run_start() {
  S->overhead_ns = 0;
  auto t = Clock::now();
  run_ops(S->start_ops);
  return ns_since(t) - S->overhead_ns;
}

// One pass over the trace's lines; `release` frees everything afterwards (inside the timing).
// Returns allocator ns (side-stream mechanism subtracted).
double run_pass(bool count, bool release) {
  S->count = count;
  S->overhead_ns = 0;
  auto t = Clock::now();
  run_ops(S->trace_ops);
  if (release) {
    for (uint64_t id = 0; id < S->handles; ++id) {
      if (S->ptr[id]) {
        alloc::raw_delete(S->ptr[id]);
        S->ptr[id] = nullptr;
      }
    }
    S->requested = 0;
    auto t2 = Clock::now();
    complete_all();
    S->overhead_ns += ns_since(t2);
  }
  double ns = ns_since(t) - S->overhead_ns;
  S->count = true;
  return ns;
}

// Frees every live handle (id order) and completes every side stream; not timed.
void release_all() {
  for (uint64_t id = 0; id < S->handles; ++id) {
    if (S->ptr[id]) {
      alloc::raw_delete(S->ptr[id]);
      S->ptr[id] = nullptr;
    }
  }
  S->requested = 0;
  complete_all();
}

std::map<std::string, double> counters() {
  std::map<std::string, double> out;
  out["peak_requested_bytes"] = (double)S->peak_requested;
  out["allocs"] = (double)S->allocs;
  out["ooms"] = (double)S->ooms;
  out["frees"] = (double)S->frees;
  out["records"] = (double)S->records;
  out["completes"] = (double)S->completes;
  out["empty_caches"] = (double)S->empties;
  out["skipped_lines"] = (double)S->skipped;
  out["forced_releases"] = (double)S->forced.load();
  out["forced_releases_outside_passes"] = (double)S->forced_outside.load();
  out["side_streams_created"] = (double)S->next_slot;
  return out;
}

void finish() {
  if (!S) return;
  S->running.store(false);
  if (S->watchdog.joinable()) S->watchdog.join();
  complete_all();
}

// ---- The side-by-side benchmark (scripts/pytorch_bench.py, docs/GPU_BENCH.md) ----

namespace {

struct Reading {
  int64_t reserved = 0, allocated = 0, device_allocs = 0, device_frees = 0;
  int64_t peak_reserved = 0, peak_allocated = 0;
};

// The allocator's own statistics for the replay's device (aggregate over its pools).
Reading read_stats() {
  const auto st = alloc::getDeviceStats(static_cast<c10::DeviceIndex>(S->device));
  constexpr size_t agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  Reading r;
  r.reserved = st.reserved_bytes[agg].current;
  r.allocated = st.allocated_bytes[agg].current;
  r.peak_reserved = st.reserved_bytes[agg].peak;
  r.peak_allocated = st.allocated_bytes[agg].peak;
  r.device_allocs = st.num_device_alloc;
  r.device_frees = st.num_device_free;
  return r;
}

}  // namespace

// The observed pass (not timed): the trace's lines (after `s`) once, the allocator's statistics
// read after every line. Sample i is the state after i lines (sample 0: after the start). Single
// figures come back as one-element lists; the timeline (`t_line`, `t_requested`, `t_reserved`,
// `t_allocated`) has at most `max_points` points, each the maximum over its bucket of samples
// and `t_line` the bucket's first sample.
std::map<std::string, std::vector<int64_t>> run_observed(int64_t max_points) {
  if (!S) throw std::runtime_error("run_observed() before prepare()");
  if (max_points < 1) throw std::runtime_error("run_observed(): max_points must be positive");
  const std::vector<Op>& ops = S->trace_ops;
  const size_t n = ops.size();
  const size_t points = static_cast<size_t>(max_points);
  const size_t per = (n + 1 + points - 1) / points;  // samples per point, at least 1
  std::vector<int64_t> t_line, t_req, t_res, t_all;
  auto sample = [&](size_t i, int64_t req, const Reading& r) {
    const size_t k = i / per;
    if (k == t_line.size()) {
      t_line.push_back(static_cast<int64_t>(k * per));
      t_req.push_back(req);
      t_res.push_back(r.reserved);
      t_all.push_back(r.allocated);
    } else {
      t_req[k] = std::max(t_req[k], req);
      t_res[k] = std::max(t_res[k], r.reserved);
      t_all[k] = std::max(t_all[k], r.allocated);
    }
  };
  S->count = true;
  const Reading first = read_stats();
  Reading prev = first;
  int64_t peak_req = static_cast<int64_t>(S->requested);
  int64_t peak_res = first.reserved, peak_all = first.allocated;
  int64_t allocs = 0, ooms = 0, hits = 0, changes = 0;
  sample(0, peak_req, first);
  S->in_run.store(true);
  try {
    for (size_t i = 0; i < n; ++i) {
      const Op& op = ops[i];
      const uint64_t ooms_before = S->ooms;  // counted (S->count) by run_op
      run_op(op);
      const Reading now = read_stats();
      if (op.kind == ALLOC) {
        ++allocs;
        if (S->ooms != ooms_before) {
          ++ooms;
        } else if (now.reserved <= prev.reserved && now.device_allocs == prev.device_allocs) {
          ++hits;  // served from the cache: no growth, no device allocation
        }
      }
      if (now.reserved != prev.reserved) ++changes;
      const int64_t req = static_cast<int64_t>(S->requested);
      peak_req = std::max(peak_req, req);
      peak_res = std::max(peak_res, now.reserved);
      peak_all = std::max(peak_all, now.allocated);
      sample(i + 1, req, now);
      prev = now;
    }
  } catch (...) {
    S->in_run.store(false);
    throw;
  }
  S->in_run.store(false);
  std::map<std::string, std::vector<int64_t>> out;
  out["lines"] = {static_cast<int64_t>(n)};
  out["allocs"] = {allocs};
  out["ooms"] = {ooms};
  out["cache_hits"] = {hits};
  out["reserved_changes"] = {changes};
  out["peak_requested"] = {peak_req};
  out["peak_reserved"] = {peak_res};
  out["peak_allocated"] = {peak_all};
  out["device_allocs"] = {prev.device_allocs - first.device_allocs};
  out["device_frees"] = {prev.device_frees - first.device_frees};
  out["stats_peak_reserved"] = {prev.peak_reserved};    // PyTorch's own peak, start included
  out["stats_peak_allocated"] = {prev.peak_allocated};
  out["t_line"] = std::move(t_line);
  out["t_requested"] = std::move(t_req);
  out["t_reserved"] = std::move(t_res);
  out["t_allocated"] = std::move(t_all);
  return out;
}

// The hot loop: `threads` std::threads, each on a CUDA stream of its own (created once, before
// any timing, and reused by later calls), each runs `warmup` then `pairs` raw_alloc_with_stream
// + raw_delete pairs of `size` bytes. The timed pairs start together at a barrier; returns the
// wall ns from the release of the barrier to the end of the last thread. Needs no prepare().
double hot_loop(int64_t size, int64_t threads, int64_t pairs, int64_t warmup) {
  if (size < 1 || threads < 1 || pairs < 1 || warmup < 0)
    throw std::runtime_error("hot_loop(): size, threads and pairs must be positive");
  static std::vector<cudaStream_t> streams;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  while (streams.size() < static_cast<size_t>(threads)) {
    cudaStream_t s = nullptr;
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    streams.push_back(s);
  }
  const size_t n = static_cast<size_t>(threads);
  std::atomic<int64_t> ready{0};
  std::atomic<bool> go{false};
  std::vector<Clock::time_point> ends(n);
  std::vector<std::string> errors(n);
  auto body = [&](size_t t) {
    cudaStream_t stream = streams[t];
    const size_t bytes = static_cast<size_t>(size);
    try {
      C10_CUDA_CHECK(cudaSetDevice(device));  // a new thread starts on device 0
      for (int64_t i = 0; i < warmup; ++i) alloc::raw_delete(alloc::raw_alloc_with_stream(bytes, stream));
    } catch (const std::exception& e) {
      errors[t] = e.what();
    }
    ready.fetch_add(1);
    while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
    if (errors[t].empty()) {
      try {
        for (int64_t i = 0; i < pairs; ++i) alloc::raw_delete(alloc::raw_alloc_with_stream(bytes, stream));
      } catch (const std::exception& e) {
        errors[t] = e.what();
      }
    }
    ends[t] = Clock::now();
  };
  std::vector<std::thread> pool;
  pool.reserve(n);
  try {
    for (size_t t = 0; t < n; ++t) pool.emplace_back(body, t);
  } catch (...) {  // a thread could not start: let the others through, then give up
    go.store(true, std::memory_order_release);
    for (auto& th : pool) th.join();
    throw;
  }
  while (ready.load() < threads) std::this_thread::yield();
  const auto t0 = Clock::now();
  go.store(true, std::memory_order_release);
  for (auto& th : pool) th.join();
  for (const auto& e : errors)
    if (!e.empty()) throw std::runtime_error("hot loop thread: " + e);
  auto last = t0;
  for (const auto& e : ends) last = std::max(last, e);
  return std::chrono::duration<double, std::nano>(last - t0).count();
}
"""

CUDA_SOURCE = r"""
__global__ void cachalot_spin_kernel(volatile unsigned int* flag) {
  while (*flag == 0) {
    __nanosleep(1000);
  }
}

void cachalot_launch_spin(cudaStream_t stream, volatile unsigned int* flag) {
  cachalot_spin_kernel<<<1, 1, 0, stream>>>(flag);
}
"""

FUNCTIONS = ["prepare", "run_start", "run_pass", "release_all", "counters", "finish",
             "run_observed", "hot_loop"]


def build(verbose=False):
    """Compiles the extension (cached under TORCH_EXTENSIONS_DIR) and imports it."""
    prebuilt = os.environ.get("CACHALOT_PYTORCH_REPLAY_EXT")
    if prebuilt and os.path.exists(prebuilt):
        # A worker: the driver built it; import the library directly (no ninja check).
        import importlib.util

        import torch  # noqa: F401  (loads libtorch first)

        spec = importlib.util.spec_from_file_location(EXT_NAME, prebuilt)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name=EXT_NAME,
        cpp_sources=[CPP_SOURCE],
        cuda_sources=[CUDA_SOURCE],
        functions=FUNCTIONS,
        extra_cflags=["-O2"],
        extra_cuda_cflags=["-O2"],
        verbose=verbose,
    )


def read_header(path):
    header = {}
    with open(path) as f:
        for line in f:
            if not line.startswith("#"):
                break
            if ": " in line:
                k, v = line[2:].rstrip("\n").split(": ", 1)
                header[k] = v
    return header


def driver_version():
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        ).stdout.strip()
        return out.splitlines()[0] if out else None
    except Exception:
        return None


def worker(job, repeat):
    """One replay in this (fresh) process; returns the figures."""
    import torch

    ext = build()
    if job.get("fraction") is not None:
        torch.cuda.set_per_process_memory_fraction(float(job["fraction"]))
    torch.cuda.init()
    header = read_header(job["ops"])
    info = ext.prepare(job["ops"])
    snapshot_path = job.get("snapshot_out")
    if snapshot_path:
        torch.cuda.memory._record_memory_history(
            enabled="all", context=None, stacks="python", max_entries=1_000_000
        )
    start_ns = ext.run_start()
    first_ns = ext.run_pass(True, False)
    # No torch.cuda.synchronize() here: a side stream whose free the trace never completed is
    # still spinning (as PyTorch held that block back at the dump), and would never finish.
    stats = {k: int(v) for k, v in torch.cuda.memory_stats().items()}
    figures = {
        "max_memory_reserved": int(torch.cuda.max_memory_reserved()),
        "max_memory_allocated": int(torch.cuda.max_memory_allocated()),
        "memory_reserved": int(torch.cuda.memory_reserved()),
        "memory_allocated": int(torch.cuda.memory_allocated()),
    }
    allocator_settings = None
    snap_info = None
    if snapshot_path:
        torch.cuda.memory._dump_snapshot(snapshot_path)
        torch.cuda.memory._record_memory_history(enabled=None)
    try:
        snap = torch.cuda.memory._snapshot()
        allocator_settings = snap.get("allocator_settings")
        segs = snap.get("segments", [])
        snap_info = {
            "segments": len(segs),
            "expandable_segments": sum(1 for s in segs if s.get("is_expandable")),
            "total_size": sum(int(s["total_size"]) for s in segs),
        }
    except Exception as err:  # older PyTorch
        snap_info = {"error": str(err)}
    counters = ext.counters()
    ext.release_all()
    steady = []
    for _ in range(1, repeat):
        steady.append(ext.run_pass(False, True))
    forced = ext.counters()["forced_releases"]
    ext.finish()
    program_ops = int(info["program_ops"]) or 1
    lines = int(info["trace_lines"]) or 1
    out = {
        "name": job["name"],
        "config": job.get("config"),
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "memory_fraction": job.get("fraction"),
        "ops_file": job["ops"],
        "ops_header": header,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "gpu_name": torch.cuda.get_device_name(0),
        "device_total_memory": int(torch.cuda.get_device_properties(0).total_memory),
        "python_version": platform.python_version(),
        "allocator_backend": torch.cuda.get_allocator_backend(),
        "allocator_settings": allocator_settings,
        **figures,
        "num_device_alloc": stats.get("num_device_alloc"),
        "num_device_free": stats.get("num_device_free"),
        "peak_segments": stats.get("segment.all.peak"),
        "num_ooms": stats.get("num_ooms"),
        "num_alloc_retries": stats.get("num_alloc_retries"),
        "num_sync_all_streams": stats.get("num_sync_all_streams"),
        "peak_requested_bytes": int(counters["peak_requested_bytes"]),
        "requested_bytes_peak_stat": stats.get("requested_bytes.all.peak"),
        "fragmentation": (
            figures["max_memory_reserved"] / counters["peak_requested_bytes"]
            if counters["peak_requested_bytes"] else None
        ),
        "replayer": {k: int(v) for k, v in counters.items()},
        "forced_releases": int(forced),
        "parallel_replays": int(os.environ.get("CACHALOT_PYTORCH_REPLAY_JOBS", "1")),
        "program_ops": program_ops,
        "trace_lines": lines,
        "start_lines": int(info["start_lines"]),
        "start_ns": start_ns,
        "first_pass_ns": first_ns,
        "ns_per_op_first": first_ns / program_ops,
        "ns_per_line_first": first_ns / lines,
        "repeat": repeat,
        "ns_per_op_steady": (sum(steady) / len(steady) / program_ops) if steady else None,
        "ns_per_line_steady": (sum(steady) / len(steady) / lines) if steady else None,
        "history_recorded_in_first_pass": bool(snapshot_path),
        "snapshot_out": snapshot_path,
        "snapshot_at_end_of_first_pass": snap_info,
        "memory_stats": stats,
        "recorded_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return out


def spawn(job, repeat, json_out, timeout):
    """Runs `job` in a fresh process under its configuration; returns (status, seconds)."""
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if job.get("conf"):
        env["PYTORCH_CUDA_ALLOC_CONF"] = job["conf"]
    env["PYTHONUNBUFFERED"] = "1"
    t = time.time()
    try:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(job),
             "--repeat", str(repeat), "--json-out", json_out],
            env=env, capture_output=True, text=True, timeout=timeout,
        )
        status = "ok" if proc.returncode == 0 else (
            f"failed: exit code {proc.returncode}: " + (proc.stderr or proc.stdout)[-1500:]
        )
    except subprocess.TimeoutExpired:
        status = f"failed: timed out after {timeout} s"
    return status, round(time.time() - t, 2)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ops", nargs="?", help="an ops file from `cachalot replay --ops-out`")
    p.add_argument("--conf", help="PYTORCH_CUDA_ALLOC_CONF for the replay (default: none)")
    p.add_argument("--fraction", type=float, help="set_per_process_memory_fraction before it")
    p.add_argument("--repeat", type=int, default=1, help="passes (2.. are the steady state)")
    p.add_argument("--snapshot-out", help="dump a snapshot with the first pass's history")
    p.add_argument("--json-out", help="write the figures here (default: stdout)")
    p.add_argument("--batch", help="a JSON list of jobs (see the module's doc)")
    p.add_argument("--out", help="with --batch: the folder for the figures")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per replay")
    p.add_argument("--jobs", type=int, default=1,
                   help="with --batch: replays run at once, each in its own process "
                   "(more than 1 perturbs the ns/op figures)")
    p.add_argument("--build", action="store_true", help="only compile the extension")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()

    if a.worker:
        job = json.loads(a.worker)
        out = worker(job, a.repeat)
        text = json.dumps(out, indent=1, sort_keys=True) + "\n"
        if a.json_out:
            with open(a.json_out, "w") as f:
                f.write(text)
        else:
            sys.stdout.write(text)
        return 0

    t = time.time()
    ext = build(verbose=False)
    os.environ["CACHALOT_PYTORCH_REPLAY_EXT"] = ext.__file__
    os.environ["CACHALOT_PYTORCH_REPLAY_JOBS"] = str(a.jobs)
    print(f"extension ready in {time.time() - t:.1f} s: {ext.__file__}", flush=True)
    if a.build:
        return 0

    if a.batch:
        if not a.out:
            p.error("--batch needs --out")
        os.makedirs(a.out, exist_ok=True)
        with open(a.batch) as f:
            jobs = json.load(f)
        index = []
        failed = 0
        for job in jobs:
            if job.get("snapshot") and not job.get("snapshot_out"):
                job["snapshot_out"] = os.path.join(a.out, job["name"] + ".pickle")

        def one(job):
            json_out = os.path.join(a.out, job["name"] + ".json")
            return job, json_out, spawn(job, a.repeat, json_out, a.timeout)

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
            results = list(pool.map(one, jobs))
        for job, json_out, (status, secs) in results:
            line = {"name": job["name"], "status": status, "seconds": secs,
                    "parallel_replays": a.jobs}
            if status == "ok":
                with open(json_out) as f:
                    r = json.load(f)
                line.update({k: r.get(k) for k in (
                    "max_memory_reserved", "max_memory_allocated", "num_device_alloc",
                    "num_device_free", "peak_requested_bytes", "ns_per_op_first",
                    "ns_per_op_steady", "forced_releases")})
                print(f"{job['name']:48} reserved {r['max_memory_reserved']:>13} allocated "
                      f"{r['max_memory_allocated']:>13} dev {r['num_device_alloc']}/"
                      f"{r['num_device_free']} ns/op {r['ns_per_op_first']:.0f}/"
                      f"{(r['ns_per_op_steady'] or 0):.0f} ({secs} s)", flush=True)
            else:
                failed += 1
                print(f"{job['name']}: {status}", flush=True)
            index.append(line)
        with open(os.path.join(a.out, "index.json"), "w") as f:
            json.dump(index, f, indent=1)
            f.write("\n")
        print(f"{len(jobs) - failed} ok, {failed} failed")
        return 1 if failed else 0

    if not a.ops:
        p.error("an ops file or --batch is required")
    job = {"name": os.path.basename(a.ops), "ops": a.ops, "conf": a.conf,
           "fraction": a.fraction, "config": a.conf or "default",
           "snapshot_out": a.snapshot_out}
    json_out = a.json_out or os.path.join("/tmp", f"pytorch_replay_{os.getpid()}.json")
    status, secs = spawn(job, a.repeat, json_out, a.timeout)
    if status != "ok":
        print(status, file=sys.stderr)
        return 1
    if not a.json_out:
        with open(json_out) as f:
            sys.stdout.write(f.read())
        os.remove(json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
