#!/usr/bin/env python3
"""Write the side-by-side GPU benchmark's synthetic workloads as `cachalot ops v1` files.

The committed traces come from real programs; these three stress what they do not:

  synthetic_many_sizes   one stream, sizes drawn log-uniformly from 512 B to 256 MiB with
                         random lifetimes (a live set of up to 256 handles, at most 6 GiB):
                         every size class and both pools, blocks split and merged all the time.
  synthetic_kv_cache     greedy generation with a KV cache that grows by concatenation: for
                         each of 8 requests (prompt 64-512 tokens, 64-448 new tokens), every
                         decode step allocates each of 12 layers' keys and values one token
                         longer and frees the old ones (torch.cat), plus per-step activations
                         and logits; the cache is dropped at the end of each request.
  synthetic_two_streams  a producer stream fills buffers that a consumer stream reads: each
                         buffer is allocated on the producer, used on the consumer
                         (`r ID SIDE`), freed by the program at once, and its side work
                         completes a few steps later (`c SIDE`); compute on the default stream
                         in between.

The files are deterministic (fixed seeds, Python's `random`), written with the header that
`cachalot replay --ops-out` writes (src/ops.rs; `program_ops` counts the operation lines).

Usage: python3 scripts/synthetic_ops.py OUTDIR
"""

import math
import os
import random
import sys

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB


class Program:
    def __init__(self, name):
        self.name = name
        self.lines = []
        self.handles = 0
        self.live = {}  # handle -> size
        self.live_bytes = 0

    def alloc(self, size, stream=0):
        h = self.handles
        self.handles += 1
        self.lines.append(f"a {h} {size} {stream}")
        self.live[h] = size
        self.live_bytes += size
        return h

    def free(self, h):
        self.lines.append(f"f {h}")
        self.live_bytes -= self.live.pop(h)

    def free_after_use_on_side(self, h):
        """A use on another stream, then the program's free: held back until `complete`."""
        self.lines.append(f"r {h} {h}")
        self.free(h)

    def complete(self, side):
        self.lines.append(f"c {side}")

    def write(self, out_dir):
        allocs = sum(1 for line in self.lines if line.startswith("a "))
        path = os.path.join(out_dir, self.name + ".ops")
        with open(path, "w") as f:
            f.write("# cachalot ops v1\n")
            f.write(f"# trace: {self.name} (scripts/synthetic_ops.py)\n")
            f.write("# device: 0\n")
            f.write("# start: fresh\n")
            f.write("# recorded_conf: -\n")
            f.write("# recorded_memory_fraction: -\n")
            f.write("# settings: -\n")
            f.write(f"# handles: {self.handles}\n")
            f.write(f"# program_ops: {len(self.lines)}\n")
            f.write("# start_allocs: 0\n")
            f.write(f"# allocs: {allocs}\n")
            f.write("s\n")
            for line in self.lines:
                f.write(line + "\n")
        return path


def many_sizes():
    rng = random.Random(0xCAC4A107)
    p = Program("synthetic_many_sizes")
    lo, hi = 512, 256 * MIB
    for _ in range(12000):
        if p.live and (len(p.live) >= 256 or rng.random() < 0.45):
            p.free(rng.choice(list(p.live)))
            continue
        size = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        # Tensors' sizes are mostly multiples of their element size.
        size -= size % 4
        if p.live_bytes + size > 6 * GIB:
            p.free(rng.choice(list(p.live)))
            continue
        p.alloc(size)
    for h in sorted(p.live):
        p.free(h)
    return p


def kv_cache():
    rng = random.Random(0x6B76)
    p = Program("synthetic_kv_cache")
    layers, batch, heads, head_dim, elem = 12, 4, 16, 64, 2
    per_token = batch * heads * head_dim * elem  # one layer's keys (or values) per token
    vocab_logits = batch * 50257 * 4
    weights = [p.alloc(rng.choice([2, 4, 8, 9]) * MIB) for _ in range(4 * layers)]
    for _request in range(6):
        prompt = rng.randrange(64, 513)
        new = rng.randrange(64, 449)
        kv = []
        # Prefill: activations for the whole prompt, then the cache.
        acts = [p.alloc(prompt * batch * 1024 * elem) for _ in range(4)]
        for _ in range(layers):
            kv.append([p.alloc(prompt * per_token), p.alloc(prompt * per_token)])
        for h in acts:
            p.free(h)
        for step in range(new):
            length = prompt + step + 1
            tmp = p.alloc(batch * 1024 * elem)
            for layer in range(layers):
                for j in range(2):
                    grown = p.alloc(length * per_token)  # torch.cat([past, new])
                    p.free(kv[layer][j])
                    kv[layer][j] = grown
                scores = p.alloc(batch * heads * length * 4)
                p.free(scores)
            logits = p.alloc(vocab_logits)
            p.free(tmp)
            p.free(logits)
        for pair in kv:
            for h in pair:
                p.free(h)
    for h in weights:
        p.free(h)
    return p


def two_streams():
    rng = random.Random(0x2_57)
    p = Program("synthetic_two_streams")
    producer, compute = 7, 0
    pending = []  # (complete at step, side)
    for step in range(3000):
        buf = p.alloc(rng.choice([1, 3, 4, 8, 12, 16, 24, 32, 48, 64]) * MIB, producer)
        work = [p.alloc(rng.randrange(1, 64) * 64 * KIB, compute) for _ in range(rng.randrange(1, 4))]
        p.free_after_use_on_side(buf)
        pending.append((step + rng.randrange(1, 9), buf))
        for h in work:
            p.free(h)
        due = [side for when, side in pending if when <= step]
        pending = [(when, side) for when, side in pending if when > step]
        for side in due:
            p.complete(side)
    for _, side in pending:
        p.complete(side)
    return p


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        sys.exit(2)
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    for make in (many_sizes, kv_cache, two_streams):
        prog = make()
        path = prog.write(out)
        print(f"{path}: {len(prog.lines)} operations, {prog.handles} handles")


if __name__ == "__main__":
    main()
