#!/usr/bin/env python3
"""Record real PyTorch CUDA caching-allocator traces for cachalot's replay fixtures.

Each workload runs in a FRESH Python process, so that memory-history recording
starts before that process's first CUDA allocation: the trace then holds every
allocation the caching allocator ever made, and replaying it from an empty
allocator must reproduce PyTorch's own numbers.

For each workload NAME this writes, into --out:

  NAME.pickle  torch.cuda.memory._dump_snapshot() (Python's pickle, protocol 4
               with Python 3.12), recorded with context=None: no stack frames,
               so files stay small.
  NAME.json    PyTorch's own figures, taken right before the dump:
               max_memory_allocated, max_memory_reserved, the full
               torch.cuda.memory_stats() dict, the PYTORCH_CUDA_ALLOC_CONF the
               process ran under, the memory fraction if one was set, torch
               version, GPU name and capacity, and counts of the trace's actions.

plus index.json (one line per workload: ok or the error) and NAME.log with the
worker's output. A failing workload is reported and the others still run.

Usage:
  python3 scripts/record_traces.py --out DIR [--only NAME ...] [--timeout S]
                                   [--alloc-conf CONF [--suffix SUFFIX]]
  python3 scripts/record_traces.py --list

--alloc-conf CONF adds CONF to every workload's PYTORCH_CUDA_ALLOC_CONF (after the
workload's own settings, comma-separated), and its outputs are named NAME + SUFFIX
(default suffix with --alloc-conf: "_expandable" when CONF is expandable_segments:True,
else "_conf"). The fixtures under tests/fixtures/expandable/ were recorded with
--alloc-conf expandable_segments:True.

Needs a CUDA GPU, PyTorch 2.x, torchvision and transformers. Nothing is
downloaded: every model is built from a config with random weights.
"""

import argparse
import json
import os
import pickle
import platform
import random
import subprocess
import sys
import time
import traceback

MAX_ENTRIES = 1_000_000

# name -> (PYTORCH_CUDA_ALLOC_CONF or None, one-line description)
WORKLOADS = {
    "seed_experiment": (
        None,
        "a=zeros([256,1024,1024]) cuda; b=zeros cuda; b=b.to('cpu'); c=zeros cuda; "
        "c=zeros cuda again; d=zeros cuda; del d; e=zeros cpu; e=e.to('cuda')",
    ),
    "resnet18_train": (
        None,
        "torchvision resnet18 (100 classes), batch 16 of 3x128x128, 4 SGD steps with momentum",
    ),
    "gpt2_train": (
        None,
        "transformers GPT2LMHeadModel, 4 layers, n_embd 768, 12 heads, vocab 50257; "
        "batch 4 x 256 tokens, 3 AdamW steps",
    ),
    "bert_infer": (
        None,
        "transformers BertModel, 4 layers, hidden 512; 20 batches under no_grad with "
        "random batch sizes 1..32 and sequence lengths 8..384 (seeded)",
    ),
    "gpt2_generate": (
        None,
        "transformers GPT2LMHeadModel, 4 layers, n_embd 512, vocab 8192; greedy decoding of "
        "96 tokens for 2 prompts of 32 tokens with a growing KV cache",
    ),
    "two_stream": (
        None,
        "pinned host batches copied in on a side stream, record_stream on the main stream, "
        "MLP compute on the main stream, next batch prefetched while computing (12 batches)",
    ),
    "empty_cache_loop": (
        None,
        "MLP training with varying batch sizes, torch.cuda.empty_cache() after every batch",
    ),
    "oversize_max_split": (
        "max_split_size_mb:64",
        "300 seeded random tensor allocations and frees of 1 B..200 MiB "
        "under max_split_size_mb:64",
    ),
    "bert_infer_roundup4": (
        "roundup_power2_divisions:4",
        "the bert_infer workload under roundup_power2_divisions:4",
    ),
    "fraction_oom_retry": (
        None,
        "set_per_process_memory_fraction to 1 GiB; 8 x 100 MiB cached, then 300 MiB "
        "(allocator releases its cache itself and retries), then a 2 GiB request that "
        "fails with OOM (caught), then small work",
    ),
}


# ---------------------------------------------------------------- workloads
# Each takes the torch module and returns a dict; its "keep" entry keeps
# tensors alive until the figures and the snapshot are taken.


def w_seed_experiment(torch):
    shape = [256, 1024, 1024]
    a = torch.zeros(shape, device="cuda")
    b = torch.zeros(shape, device="cuda")
    b = b.to("cpu")
    c = torch.zeros(shape, device="cuda")
    c = torch.zeros(shape, device="cuda")
    d = torch.zeros(shape, device="cuda")
    del d
    e = torch.zeros(shape)
    e = e.to("cuda")
    torch.cuda.synchronize()
    return {"keep": (a, b, c, e)}


def w_resnet18_train(torch):
    import torchvision

    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = False
    model = torchvision.models.resnet18(weights=None, num_classes=100).cuda().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    loss = None
    for _ in range(4):
        x = torch.randn(16, 3, 128, 128, device="cuda")
        y = torch.randint(0, 100, (16,), device="cuda")
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    return {"keep": (model, opt), "loss": float(loss)}


def w_gpt2_train(torch):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=768, n_head=12, n_positions=512, vocab_size=50257)
    model = GPT2LMHeadModel(cfg).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss = None
    for _ in range(3):
        ids = torch.randint(0, cfg.vocab_size, (4, 256), device="cuda")
        out = model(input_ids=ids, labels=ids, use_cache=False)
        loss = out.loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out
    torch.cuda.synchronize()
    return {"keep": (model, opt), "loss": float(loss)}


def _bert(torch):
    from transformers import BertConfig, BertModel

    rng = random.Random(1234)
    torch.manual_seed(0)
    cfg = BertConfig(
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        intermediate_size=2048,
        vocab_size=30522,
        max_position_embeddings=512,
    )
    model = BertModel(cfg).cuda().eval()
    shapes = []
    total = 0.0
    with torch.no_grad():
        for _ in range(20):
            bs = rng.randint(1, 32)
            sl = rng.randint(8, 384)
            shapes.append([bs, sl])
            ids = torch.randint(0, cfg.vocab_size, (bs, sl), device="cuda")
            mask = torch.ones_like(ids)
            out = model(input_ids=ids, attention_mask=mask)
            total += float(out.last_hidden_state.float().mean())
            del out, ids, mask
    torch.cuda.synchronize()
    return {"keep": (model,), "shapes": shapes, "checksum": total}


def w_bert_infer(torch):
    return _bert(torch)


def w_bert_infer_roundup4(torch):
    return _bert(torch)


def w_gpt2_generate(torch):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=512, n_head=8, n_positions=1024, vocab_size=8192)
    model = GPT2LMHeadModel(cfg).cuda().eval()
    with torch.no_grad():
        ids = torch.randint(0, cfg.vocab_size, (2, 32), device="cuda")
        out = model(input_ids=ids, use_cache=True)
        past = out.past_key_values
        tokens = [ids]
        for _ in range(96):
            nxt = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
            tokens.append(nxt)
            out = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
        seq = torch.cat(tokens, dim=1)
    torch.cuda.synchronize()
    return {"keep": (model, seq), "generated": list(seq.shape)}


def w_two_stream(torch):
    torch.manual_seed(0)
    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)
    ).cuda()
    host = [torch.randn(256, 1024).pin_memory() for _ in range(4)]

    def fetch(i):
        with torch.cuda.stream(side):
            x = host[i % len(host)].to("cuda", non_blocking=True)
        return x

    total = 0.0
    with torch.no_grad():
        nxt = fetch(0)
        for i in range(12):
            main.wait_stream(side)
            x = nxt
            x.record_stream(main)
            if i + 1 < 12:
                nxt = fetch(i + 1)  # prefetch while computing
            y = model(x)
            total += float(y.sum())
            del x, y
    torch.cuda.synchronize()
    return {"keep": (model,), "checksum": total}


def w_empty_cache_loop(torch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(2048, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)
    ).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sizes = [64, 256, 32, 512, 128, 1024, 16, 384]
    for bs in sizes:
        x = torch.randn(bs, 2048, device="cuda")
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x, loss
        torch.cuda.empty_cache()
    torch.cuda.synchronize()
    return {"keep": (model, opt), "batch_sizes": sizes}


def w_oversize_max_split(torch):
    rng = random.Random(7)
    live = []
    for _ in range(300):
        if live and rng.random() < 0.45:
            live.pop(rng.randrange(len(live)))
        else:
            kind = rng.random()
            if kind < 0.4:
                nbytes = rng.randint(1, 1 << 20)
            elif kind < 0.75:
                nbytes = rng.randint(1 << 20, 16 << 20)
            else:
                nbytes = rng.randint(16 << 20, 200 << 20)
            live.append(torch.empty(nbytes, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    return {"keep": live, "live_at_end": len(live)}


def w_fraction_oom_retry(torch):
    total = torch.cuda.get_device_properties(0).total_memory
    limit = 1 << 30
    fraction = limit / total
    torch.cuda.set_per_process_memory_fraction(fraction)
    mib = 1 << 20
    xs = [torch.empty(100 * mib, dtype=torch.uint8, device="cuda") for _ in range(8)]
    del xs  # 800 MiB cached in 8 whole free segments
    y = torch.empty(300 * mib, dtype=torch.uint8, device="cuda")  # 800 + 300 > 1024: retry
    oom = None
    try:
        z = torch.empty(2048 * mib, dtype=torch.uint8, device="cuda")
        del z
    except RuntimeError as err:  # torch.OutOfMemoryError
        oom = str(err).splitlines()[0]
    small = [torch.empty(4096 * (i + 1), dtype=torch.uint8, device="cuda") for i in range(16)]
    del y
    w = torch.empty(500 * mib, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    return {"keep": (small, w), "memory_fraction": fraction, "limit_bytes": limit, "oom": oom}


# ---------------------------------------------------------------- worker


def run_worker(name, out_dir, suffix=""):
    import torch

    # Start recording before anything touches CUDA memory.
    torch.cuda.memory._record_memory_history(
        enabled="all", context=None, stacks="python", max_entries=MAX_ENTRIES
    )
    started = time.time()
    result = globals()["w_" + name](torch)
    torch.cuda.synchronize()
    elapsed = time.time() - started

    stats = dict(torch.cuda.memory_stats())
    props = torch.cuda.get_device_properties(0)
    conf, description = WORKLOADS[name]
    figures = {
        "workload": name,
        "description": description,
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "memory_fraction": result.get("memory_fraction"),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "gpu_name": torch.cuda.get_device_name(0),
        "device_total_memory": int(props.total_memory),
        "allocator_backend": torch.cuda.get_allocator_backend(),
        "max_memory_allocated": int(torch.cuda.max_memory_allocated()),
        "max_memory_reserved": int(torch.cuda.max_memory_reserved()),
        "memory_allocated": int(torch.cuda.memory_allocated()),
        "memory_reserved": int(torch.cuda.memory_reserved()),
        "memory_stats": {k: int(v) for k, v in stats.items()},
        "record_memory_history": {
            "enabled": "all",
            "context": None,
            "max_entries": MAX_ENTRIES,
        },
        "workload_seconds": round(elapsed, 3),
        "recorded_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "details": {k: v for k, v in result.items() if k not in ("keep", "memory_fraction")},
    }

    if suffix:
        figures["output_name"] = name + suffix
    pickle_path = os.path.join(out_dir, name + suffix + ".pickle")
    torch.cuda.memory._dump_snapshot(pickle_path)

    with open(pickle_path, "rb") as f:
        snap = pickle.load(f)
    counts = {}
    per_device = []
    for trace in snap.get("device_traces", []):
        per_device.append(len(trace))
        for e in trace:
            counts[e["action"]] = counts.get(e["action"], 0) + 1
    figures["trace_entries_per_device"] = per_device
    figures["trace_action_counts"] = counts
    figures["trace_may_be_truncated"] = any(n >= MAX_ENTRIES for n in per_device)
    figures["snapshot_segments"] = len(snap.get("segments", []))
    figures["snapshot_keys"] = sorted(snap.keys())
    figures["pickle_bytes"] = os.path.getsize(pickle_path)

    with open(os.path.join(out_dir, name + suffix + ".json"), "w") as f:
        json.dump(figures, f, indent=1, sort_keys=True)
        f.write("\n")
    print(
        f"{name + suffix}: {sum(per_device)} trace entries, peak reserved "
        f"{figures['max_memory_reserved']}, peak allocated {figures['max_memory_allocated']}, "
        f"{figures['pickle_bytes']} pickle bytes, {elapsed:.2f} s"
    )


# ---------------------------------------------------------------- driver


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="output folder")
    parser.add_argument("--only", nargs="*", help="workload names (default: all)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per workload")
    parser.add_argument("--list", action="store_true", help="list the workloads")
    parser.add_argument(
        "--alloc-conf",
        help="added to every workload's PYTORCH_CUDA_ALLOC_CONF (e.g. expandable_segments:True)",
    )
    parser.add_argument("--suffix", help="appended to output names (default: see --help)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    suffix = args.suffix
    if suffix is None:
        if not args.alloc_conf:
            suffix = ""
        elif args.alloc_conf.replace(" ", "") == "expandable_segments:True":
            suffix = "_expandable"
        else:
            suffix = "_conf"

    if args.list:
        for name, (conf, desc) in WORKLOADS.items():
            print(f"{name:22} {conf or '-':28} {desc}")
        return 0
    if not args.out:
        parser.error("--out is required")
    os.makedirs(args.out, exist_ok=True)

    if args.worker:
        run_worker(args.worker, args.out, suffix)
        return 0

    names = args.only or list(WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads: {unknown}")

    index = {}
    for name in names:
        conf, _ = WORKLOADS[name]
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        conf = ",".join(c for c in (conf, args.alloc_conf) if c) or None
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        env["PYTHONUNBUFFERED"] = "1"
        out_name = name + suffix
        log_path = os.path.join(args.out, out_name + ".log")
        started = time.time()
        try:
            with open(log_path, "w") as log:
                proc = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--worker", name, "--out", args.out,
                     "--suffix", suffix],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=args.timeout,
                )
            status = "ok" if proc.returncode == 0 else f"failed: exit code {proc.returncode}"
        except subprocess.TimeoutExpired:
            status = f"failed: timed out after {args.timeout} s"
        except Exception:  # keep going with the other workloads
            status = "failed: " + traceback.format_exc(limit=1).strip().splitlines()[-1]
        index[out_name] = {
            "status": status,
            "pytorch_cuda_alloc_conf": conf,
            "seconds": round(time.time() - started, 2),
        }
        with open(log_path) as log:
            tail = log.read()[-2000:]
        print(f"== {out_name}: {status} ({index[out_name]['seconds']} s)\n{tail}", flush=True)

    with open(os.path.join(args.out, "index.json"), "w") as f:
        json.dump(index, f, indent=1)
        f.write("\n")
    failed = [n for n, v in index.items() if v["status"] != "ok"]
    print(f"{len(names) - len(failed)} ok, {len(failed)} failed {failed}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
