#!/usr/bin/env python3
"""Record PyTorch memory snapshots the way users record them, for cachalot's fixtures.

`record_traces.py` records every allocation of a fresh process without stack frames. Users
do none of that: they call `torch.cuda.memory._record_memory_history()` with its defaults
(Python and C++ stack frames on every entry), often only after a warm-up step with the peaks
reset, sometimes with a small `max_entries` so that the ring wraps, sometimes on several
GPUs. Each workload here runs in a fresh Python process and writes into --out:

  NAME.pickle.gz  torch.cuda.memory._dump_snapshot(), exactly as PyTorch wrote it, gzipped
                  (cachalot reads gzip; PyTorch's pickle is untouched inside)
  NAME.json       PyTorch's own figures, per device: over the recorded window
                  (max_memory_allocated / max_memory_reserved, with the peaks reset where
                  the window's measurement starts) and at the dump (memory_stats()), how the
                  history was recorded, and, when the peaks were reset in the middle of the
                  recorded trace, the last trace entry before the reset (`reset_after`)

Usage:
  python3 scripts/record_user_snapshots.py --out DIR [--only NAME ...]
                                           [--alloc-conf CONF [--suffix SUFFIX]]
  python3 scripts/record_user_snapshots.py --list

Needs a CUDA GPU (two for `two_devices`), PyTorch 2.x, torchvision and transformers.
Nothing is downloaded: every model is built from a config with random weights.
"""

import argparse
import gzip
import json
import os
import pickle
import platform
import shutil
import subprocess
import sys
import time

WORKLOADS = {
    "gpt2_train_frames": "GPT-2 (4 layers, n_embd 768) training, 3 AdamW steps; "
    "_record_memory_history() at its defaults from the process's first allocation",
    "resnet50_warm": "torchvision ResNet-50 training, batch 16 of 3x160x160: one warm-up step, "
    "then reset_peak_memory_stats() and _record_memory_history() at its defaults, 2 more steps",
    "unet_wrapped": "a U-Net (4 levels) training, batch 8 of 3x128x128, 6 SGD steps; "
    "_record_memory_history(max_entries=1500) from the start, so the ring wraps; peaks reset "
    "before the last step (reset_after names the last entry before the reset)",
    "two_devices": "a two-stage pipeline, stage 1 on cuda:0 and stage 2 on cuda:1, 4 training "
    "steps; _record_memory_history() at its defaults",
    "gpt2_generate_large": "GPT-2 (4 layers, n_embd 512) greedy generation of 420 tokens for "
    "2 prompts with a growing KV cache; _record_memory_history() at its defaults (the large one)",
}


def last_entries(torch):
    """The last trace entry of each device, as plain values (to mark a peak reset)."""
    snap = torch.cuda.memory._snapshot()
    out = []
    for trace in snap["device_traces"]:
        if trace:
            e = trace[-1]
            out.append({k: e.get(k) for k in ("action", "addr", "size", "stream", "time_us")})
        else:
            out.append(None)
    return out


def figures(torch):
    per = []
    for d in range(torch.cuda.device_count()):
        stats = torch.cuda.memory_stats(d)
        per.append(
            {
                "device": d,
                "max_memory_allocated": int(torch.cuda.max_memory_allocated(d)),
                "max_memory_reserved": int(torch.cuda.max_memory_reserved(d)),
                "memory_allocated": int(torch.cuda.memory_allocated(d)),
                "memory_reserved": int(torch.cuda.memory_reserved(d)),
                "memory_stats": {k: int(v) for k, v in stats.items()},
            }
        )
    return per


def w_gpt2_train_frames(torch, ctx):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.cuda.memory._record_memory_history()
    ctx["history"] = "_record_memory_history() (defaults), before the first allocation"
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=768, n_head=12, n_positions=512, vocab_size=50257)
    model = GPT2LMHeadModel(cfg).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(3):
        ids = torch.randint(0, cfg.vocab_size, (4, 256), device="cuda")
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out
    torch.cuda.synchronize()
    return (model, opt)


def w_resnet50_warm(torch, ctx):
    import torchvision

    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = False
    model = torchvision.models.resnet50(weights=None).cuda().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        x = torch.randn(16, 3, 160, 160, device="cuda")
        y = torch.randint(0, 1000, (16,), device="cuda")
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()

    step()
    torch.cuda.synchronize()
    ctx["stats_at_start"] = figures(torch)
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history()
    ctx["history"] = "_record_memory_history() (defaults) after one warm-up step and a peak reset"
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    return (model, opt)


def w_unet_wrapped(torch, ctx):
    # The same 4-level U-Net as the seed's recording (scripts/record_unet.py).
    from record_unet import build

    torch.cuda.memory._record_memory_history(max_entries=1500)
    ctx["history"] = "_record_memory_history(max_entries=1500) before the first allocation"
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = False
    model = build(torch).cuda().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    for i in range(6):
        if i == 5:
            torch.cuda.synchronize()
            ctx["reset_after"] = last_entries(torch)
            ctx["stats_at_reset"] = figures(torch)
            torch.cuda.reset_peak_memory_stats()
        x = torch.randn(8, 3, 128, 128, device="cuda")
        y = torch.randint(0, 2, (8, 128, 128), device="cuda")
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        del x, y, loss
    torch.cuda.synchronize()
    return (model, opt)


def w_two_devices(torch, ctx):
    nn = torch.nn
    if torch.cuda.device_count() < 2:
        raise RuntimeError("two_devices needs two GPUs")
    torch.cuda.memory._record_memory_history()
    ctx["history"] = "_record_memory_history() (defaults), before the first allocation"
    torch.manual_seed(0)
    s1 = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 2048)).to("cuda:0")
    s2 = nn.Sequential(nn.Linear(2048, 4096), nn.GELU(), nn.Linear(4096, 10)).to("cuda:1")
    opt = torch.optim.Adam(list(s1.parameters()) + list(s2.parameters()), lr=1e-3)
    for bs in (64, 256, 128, 512):
        x = torch.randn(bs, 1024, device="cuda:0")
        y = torch.randint(0, 10, (bs,), device="cuda:1")
        h = s1(x).to("cuda:1")
        loss = nn.functional.cross_entropy(s2(h), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x, y, h, loss
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    return (s1, s2, opt)


def w_gpt2_generate_large(torch, ctx):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.cuda.memory._record_memory_history()
    ctx["history"] = "_record_memory_history() (defaults), before the first allocation"
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=512, n_head=8, n_positions=1024, vocab_size=8192)
    model = GPT2LMHeadModel(cfg).cuda().eval()
    with torch.no_grad():
        ids = torch.randint(0, cfg.vocab_size, (2, 32), device="cuda")
        out = model(input_ids=ids, use_cache=True)
        past = out.past_key_values
        tokens = [ids]
        for _ in range(420):
            nxt = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
            tokens.append(nxt)
            out = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
        seq = torch.cat(tokens, dim=1)
    torch.cuda.synchronize()
    return (model, seq)


def run_worker(name, out_dir, suffix=""):
    import torch

    ctx = {}
    started = time.time()
    keep = globals()["w_" + name](torch, ctx)
    elapsed = time.time() - started
    fig = {
        "workload": name,
        "description": WORKLOADS[name],
        "record_memory_history": ctx.pop("history"),
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "gpu_name": torch.cuda.get_device_name(0),
        "device_count": torch.cuda.device_count(),
        "device_total_memory": int(torch.cuda.get_device_properties(0).total_memory),
        "workload_seconds": round(elapsed, 3),
        "recorded_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "devices": figures(torch),
    }
    fig.update(ctx)
    if suffix:
        fig["output_name"] = name + suffix
    raw = os.path.join(out_dir, name + suffix + ".pickle")
    t = time.time()
    torch.cuda.memory._dump_snapshot(raw)
    fig["dump_seconds"] = round(time.time() - t, 3)
    del keep
    fig["pickle_bytes"] = os.path.getsize(raw)
    t = time.time()
    with open(raw, "rb") as f:
        snap = pickle.load(f)
    fig["pickle_load_seconds_on_gpu_host"] = round(time.time() - t, 3)
    fig["trace_entries_per_device"] = [len(tr) for tr in snap["device_traces"]]
    frames = [len(e.get("frames", [])) for tr in snap["device_traces"] for e in tr]
    fig["mean_frames_per_entry"] = round(sum(frames) / max(1, len(frames)), 1)
    fig["snapshot_segments_per_device"] = [
        sum(1 for s in snap["segments"] if s["device"] == d)
        for d in range(len(snap["device_traces"]))
    ]
    counts = {}
    for tr in snap["device_traces"]:
        for e in tr:
            counts[e["action"]] = counts.get(e["action"], 0) + 1
    fig["trace_action_counts"] = counts
    with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb", compresslevel=9) as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)
    with open(os.path.join(out_dir, name + suffix + ".json"), "w") as f:
        json.dump(fig, f, indent=1, sort_keys=True)
        f.write("\n")
    print(
        f"{name}: entries {fig['trace_entries_per_device']}, frames/entry "
        f"{fig['mean_frames_per_entry']}, {fig['pickle_bytes']} bytes, "
        f"dump {fig['dump_seconds']} s, load {fig['pickle_load_seconds_on_gpu_host']} s, "
        f"peak reserved {[d['max_memory_reserved'] for d in fig['devices']]}"
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--only", nargs="*")
    p.add_argument("--timeout", type=float, default=400.0)
    p.add_argument("--list", action="store_true")
    p.add_argument(
        "--alloc-conf",
        help="PYTORCH_CUDA_ALLOC_CONF for every workload (e.g. expandable_segments:True)",
    )
    p.add_argument("--suffix", help="appended to output names (default with --alloc-conf: "
                   "_expandable for expandable_segments:True, else _conf)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    suffix = a.suffix
    if suffix is None:
        if not a.alloc_conf:
            suffix = ""
        elif a.alloc_conf.replace(" ", "") == "expandable_segments:True":
            suffix = "_expandable"
        else:
            suffix = "_conf"
    if a.list:
        for k, v in WORKLOADS.items():
            print(f"{k:22} {v}")
        return 0
    if not a.out:
        p.error("--out is required")
    os.makedirs(a.out, exist_ok=True)
    if a.worker:
        run_worker(a.worker, a.out, suffix)
        return 0
    names = a.only or list(WORKLOADS)
    env = dict(os.environ)
    if a.alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = a.alloc_conf
    procs = {}
    for n in names:
        log = open(os.path.join(a.out, n + suffix + ".log"), "w")
        procs[n] = subprocess.Popen(
            [sys.executable, __file__, "--out", a.out, "--worker", n, "--suffix", suffix],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
    failed = 0
    for n, pr in procs.items():
        try:
            rc = pr.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            pr.kill()
            rc = "timeout"
        print(f"{n}: {'ok' if rc == 0 else rc}")
        failed += rc != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
