#!/usr/bin/env python3
"""Record the second seed's question: a U-Net that uses far more memory while training than at
test time. Two snapshots, each in a fresh Python process, `_record_memory_history()` at its
defaults (Python and C++ frames) before the first CUDA allocation:

  unet_train_eval   4 Adam steps of training (batch 8 of 3x256x256, 2 classes), then 4
                    evaluation batches under model.eval() and torch.no_grad() in the same
                    process, as a training script with a validation loop does
  unet_eval         the same model, only the 4 evaluation batches (a fresh process)

Into --out: NAME.pickle.gz (PyTorch's _dump_snapshot(), untouched, gzipped) and NAME.json
(PyTorch's figures, in the format of tests/fixtures/user/: per device max_memory_allocated /
max_memory_reserved over the whole recording, memory_stats() at the dump; plus, for
unet_train_eval, `phases`: the trace entry at which evaluation begins (`eval_starts_at_entry`,
the number of entries recorded before it) and each phase's own peaks, the peaks being reset
between them, and `outside_allocator_bytes`: mem_get_info total - free - memory_reserved at the
end, the CUDA context and libraries).

Then, anywhere (no GPU), the seed's answers:
  cachalot explain OUT/unet_train_eval.pickle.gz                        # the training peak
  cachalot explain OUT/unet_train_eval.pickle.gz --at entry:E           # when evaluation begins
  cachalot fit OUT/unet_train_eval.pickle.gz ; cachalot fit OUT/unet_eval.pickle.gz

Usage:  python3 scripts/record_unet.py --out DIR
Needs a CUDA GPU and PyTorch 2.x; nothing is downloaded.
"""

import argparse
import gzip
import json
import os
import platform
import shutil
import subprocess
import sys
import time

STEPS = 4
EVAL_BATCHES = 4
BATCH = 8
SIZE = 256


def build(torch):
    nn = torch.nn

    def block(i, o):
        return nn.Sequential(
            nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(inplace=True),
            nn.Conv2d(o, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(inplace=True),
        )

    class UNet(nn.Module):
        def __init__(self, ch=(32, 64, 128, 256)):
            super().__init__()
            self.down = nn.ModuleList()
            c = 3
            for o in ch:
                self.down.append(block(c, o))
                c = o
            self.mid = block(ch[-1], ch[-1] * 2)
            self.up = nn.ModuleList()
            self.dec = nn.ModuleList()
            c = ch[-1] * 2
            for o in reversed(ch):
                self.up.append(nn.ConvTranspose2d(c, o, 2, stride=2))
                self.dec.append(block(2 * o, o))
                c = o
            self.head = nn.Conv2d(c, 2, 1)

        def forward(self, x):
            skips = []
            for d in self.down:
                x = d(x)
                skips.append(x)
                x = nn.functional.max_pool2d(x, 2)
            x = self.mid(x)
            for up, dec, skip in zip(self.up, self.dec, reversed(skips)):
                x = dec(torch.cat([up(x), skip], dim=1))
            return self.head(x)

    return UNet()


def figures(torch):
    stats = torch.cuda.memory_stats(0)
    return {
        "device": 0,
        "max_memory_allocated": int(torch.cuda.max_memory_allocated(0)),
        "max_memory_reserved": int(torch.cuda.max_memory_reserved(0)),
        "memory_allocated": int(torch.cuda.memory_allocated(0)),
        "memory_reserved": int(torch.cuda.memory_reserved(0)),
        "memory_stats": {k: int(v) for k, v in stats.items()},
    }


def entries_now(torch):
    return len(torch.cuda.memory._snapshot()["device_traces"][0])


def train(torch, model, steps):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    model.train()
    for _ in range(steps):
        x = torch.randn(BATCH, 3, SIZE, SIZE, device="cuda")
        y = torch.randint(0, 2, (BATCH, SIZE, SIZE), device="cuda")
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
    return opt


def evaluate(torch, model, batches):
    model.eval()
    correct = 0
    with torch.no_grad():
        for _ in range(batches):
            x = torch.randn(BATCH, 3, SIZE, SIZE, device="cuda")
            y = torch.randint(0, 2, (BATCH, SIZE, SIZE), device="cuda")
            correct += int((model(x).argmax(dim=1) == y).sum())
    return correct


def worker(name, out_dir):
    import torch

    torch.cuda.memory._record_memory_history()
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = False
    fig = {"workload": name, "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    t = time.time()
    model = build(torch).cuda()
    keep = [model]
    if name == "unet_train_eval":
        fig["description"] = (f"U-Net (4 levels, 32-256 channels) training, {STEPS} Adam steps of batch "
                              f"{BATCH} x 3x{SIZE}x{SIZE}, then {EVAL_BATCHES} evaluation batches under "
                              "model.eval() and torch.no_grad() in the same process")
        keep.append(train(torch, model, STEPS))
        torch.cuda.synchronize()
        train_fig = figures(torch)
        eval_starts = entries_now(torch)
        torch.cuda.reset_peak_memory_stats()
        evaluate(torch, model, EVAL_BATCHES)
        torch.cuda.synchronize()
        eval_fig = figures(torch)
        whole = dict(eval_fig)
        whole["max_memory_allocated"] = max(train_fig["max_memory_allocated"], eval_fig["max_memory_allocated"])
        whole["max_memory_reserved"] = max(train_fig["max_memory_reserved"], eval_fig["max_memory_reserved"])
        fig["devices"] = [whole]
        fig["phases"] = {
            "eval_starts_at_entry": eval_starts,
            "train": {k: train_fig[k] for k in ("max_memory_allocated", "max_memory_reserved",
                                                "memory_allocated", "memory_reserved")},
            "eval": {k: eval_fig[k] for k in ("max_memory_allocated", "max_memory_reserved",
                                              "memory_allocated", "memory_reserved")},
            "note": "peaks reset when evaluation begins; eval's figures are over evaluation alone",
        }
    else:
        fig["description"] = (f"the same U-Net, only {EVAL_BATCHES} evaluation batches of {BATCH} x "
                              f"3x{SIZE}x{SIZE} under model.eval() and torch.no_grad(), fresh process")
        evaluate(torch, model, EVAL_BATCHES)
        torch.cuda.synchronize()
        fig["devices"] = [figures(torch)]
    free, total = torch.cuda.mem_get_info()
    fig.update({
        "record_memory_history": "_record_memory_history() (defaults), before the first allocation",
        "outside_allocator_bytes": int(total - free - torch.cuda.memory_reserved()),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "gpu_name": torch.cuda.get_device_name(0),
        "device_count": torch.cuda.device_count(),
        "device_total_memory": int(torch.cuda.get_device_properties(0).total_memory),
        "workload_seconds": round(time.time() - t, 3),
        "recorded_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    })
    raw = os.path.join(out_dir, name + ".pickle")
    torch.cuda.memory._dump_snapshot(raw)
    del keep
    import pickle

    with open(raw, "rb") as f:
        snap = pickle.load(f)
    fig["trace_entries_per_device"] = [len(tr) for tr in snap["device_traces"]]
    counts = {}
    for tr in snap["device_traces"]:
        for e in tr:
            counts[e["action"]] = counts.get(e["action"], 0) + 1
    fig["trace_action_counts"] = counts
    fig["pickle_bytes"] = os.path.getsize(raw)
    with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb", compresslevel=9) as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(fig, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"{name}: {fig['trace_entries_per_device']} entries, peak reserved "
          f"{fig['devices'][0]['max_memory_reserved']:,} B, peak allocated "
          f"{fig['devices'][0]['max_memory_allocated']:,} B"
          + (f", phases {json.dumps(fig['phases'])}" if "phases" in fig else ""), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.worker:
        worker(a.worker, a.out)
        return 0
    failed = 0
    for name in ("unet_train_eval", "unet_eval"):
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--out", a.out, "--worker", name])
        failed += r.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
