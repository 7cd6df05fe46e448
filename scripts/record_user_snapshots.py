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
    # Issue 23's four kinds of snapshot, recorded as users record them.
    "diffusion_wrapped": "a diffusion U-Net (sinusoidal time embedding, GroupNorm residual blocks, "
    "self-attention at 1/2 and 1/4 resolution) trained on batch 32 of 3x64x64 under fp16 "
    "autocast with GradScaler and AdamW, 20 steps; _record_memory_history(max_entries=10_000) at its defaults "
    "(frames) from the start, so the ring wraps; peaks reset before the last step",
    "diffusion_multires_wrapped": "the same diffusion U-Net, resolution and batch changing every "
    "step (multi-aspect training: 32/48/64/40 px, batch 48/32/24/40), fp16 autocast with "
    "GradScaler, 16 steps; max_entries=6000, the ring wraps; peaks reset before the last step",
    "gpt2_bf16_wrapped": "GPT-2 (4 layers, n_embd 512) training under bf16 autocast with "
    "sequence lengths changing every step (128/256/192/320, batch 8), 12 AdamW steps; "
    "max_entries=4000, the ring wraps; peaks reset before the last step",
    "lstm_expandable_warm": "an LSTM language model (vocab 16000, embedding 512, 2 layers of 1024) "
    "under expandable_segments:True, batch 32 x 128 tokens: three warm-up steps, then "
    "reset_peak_memory_stats() and _record_memory_history() at its defaults, 3 more steps with "
    "sequence lengths 96/160/128",
    "cuda_graph_mlp": "an MLP training step captured with torch.cuda.graph (warm-up on a side "
    "stream, as PyTorch's docs show; the graph's private pool) and replayed 5 times, eager "
    "inference at another batch size between the replays; then the graph and its outputs "
    "deleted and 2 eager steps; _record_memory_history() at its defaults from the start",
    "mempool_mlp": "tensors made inside torch.cuda.use_mem_pool(torch.cuda.MemPool()) beside "
    "eager MLP inference, then the pool's tensors and the pool deleted and more eager work; "
    "_record_memory_history() at its defaults from the start",
    "compile_reduce_overhead": "an MLP under torch.compile(mode='reduce-overhead') (CUDA graph "
    "trees), 6 inference steps under no_grad; _record_memory_history() at its defaults from the "
    "start (compilation included)",
    "resnet50_fraction": "torchvision ResNet-50 training, 3x160x160, batch sizes changing every "
    "step (24/48/32/52/40/52/28/44), SGD with momentum, under "
    "PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:0.6,max_split_size_mb:128 and "
    "torch.cuda.set_per_process_memory_fraction(5 GiB / total) called in the program; "
    "_record_memory_history() at its defaults from the start",
    "settings_runtime": "seeded random allocations and frees of 1 KiB-64 MiB; halfway, "
    "torch.cuda.memory._set_allocator_settings('max_split_size_mb:32,roundup_power2_divisions:4') "
    "changes the settings at run time; _record_memory_history() at its defaults from the start",
}

# Each workload's own PYTORCH_CUDA_ALLOC_CONF (before --alloc-conf's, which is appended).
WORKLOAD_CONF = {
    "lstm_expandable_warm": "expandable_segments:True",
    "resnet50_fraction": "garbage_collection_threshold:0.6,max_split_size_mb:128",
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

    nn = torch.nn
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


def mark_reset(torch, ctx):
    """Resets the peaks, remembering the last entry before the reset and the figures then."""
    torch.cuda.synchronize()
    ctx["reset_after"] = last_entries(torch)
    ctx["stats_at_reset"] = figures(torch)
    torch.cuda.reset_peak_memory_stats()


def diffusion_unet(torch, ch=(64, 128, 256), attn_levels=(1, 2), tdim=256):
    nn = torch.nn
    F = nn.functional
    import math

    class Res(nn.Module):
        def __init__(self, i, o):
            super().__init__()
            self.n1 = nn.GroupNorm(8, i)
            self.c1 = nn.Conv2d(i, o, 3, padding=1)
            self.t = nn.Linear(tdim, o)
            self.n2 = nn.GroupNorm(8, o)
            self.c2 = nn.Conv2d(o, o, 3, padding=1)
            self.skip = nn.Conv2d(i, o, 1) if i != o else nn.Identity()

        def forward(self, x, temb):
            h = self.c1(F.silu(self.n1(x)))
            h = h + self.t(F.silu(temb))[:, :, None, None]
            h = self.c2(F.silu(self.n2(h)))
            return h + self.skip(x)

    class Attn(nn.Module):
        def __init__(self, c, heads=4):
            super().__init__()
            self.n = nn.GroupNorm(8, c)
            self.qkv = nn.Conv2d(c, 3 * c, 1)
            self.o = nn.Conv2d(c, c, 1)
            self.h = heads

        def forward(self, x):
            b, c, hh, ww = x.shape
            q, k, v = self.qkv(self.n(x)).reshape(b, 3, self.h, c // self.h, hh * ww).unbind(1)
            a = F.scaled_dot_product_attention(
                q.transpose(-1, -2), k.transpose(-1, -2), v.transpose(-1, -2)
            )
            return x + self.o(a.transpose(-1, -2).reshape(b, c, hh, ww))

    class UNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.temb = nn.Sequential(nn.Linear(tdim, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
            self.inp = nn.Conv2d(3, ch[0], 3, padding=1)
            self.down = nn.ModuleList()
            self.dattn = nn.ModuleList()
            c = ch[0]
            for lvl, o in enumerate(ch):
                self.down.append(Res(c, o))
                self.dattn.append(Attn(o) if lvl in attn_levels else nn.Identity())
                c = o
            self.mid1 = Res(c, c)
            self.mida = Attn(c)
            self.mid2 = Res(c, c)
            self.up = nn.ModuleList()
            self.uattn = nn.ModuleList()
            for lvl, o in reversed(list(enumerate(ch))):
                self.up.append(Res(c + o, o))
                self.uattn.append(Attn(o) if lvl in attn_levels else nn.Identity())
                c = o
            self.out = nn.Sequential(nn.GroupNorm(8, c), nn.SiLU(), nn.Conv2d(c, 3, 3, padding=1))

        def forward(self, x, t):
            half = tdim // 2
            freqs = torch.exp(-math.log(10000) * torch.arange(half, device=x.device) / half)
            e = t.float()[:, None] * freqs[None]
            temb = self.temb(torch.cat([e.sin(), e.cos()], dim=1))
            h = self.inp(x)
            skips = []
            for i, (r, a) in enumerate(zip(self.down, self.dattn)):
                h = a(r(h, temb))
                skips.append(h)
                if i < len(self.down) - 1:
                    h = F.avg_pool2d(h, 2)
            h = self.mid2(self.mida(self.mid1(h, temb)), temb)
            for i, (r, a) in enumerate(zip(self.up, self.uattn)):
                s = skips.pop()
                if h.shape[-1] != s.shape[-1]:
                    h = F.interpolate(h, size=s.shape[-2:], mode="nearest")
                h = a(r(torch.cat([h, s], dim=1), temb))
            return self.out(h)

    return UNet()


def diffusion_train(torch, ctx, steps, shapes):
    F = torch.nn.functional
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = False
    model = diffusion_unet(torch).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cuda")
    betas = torch.linspace(1e-4, 0.02, 1000, device="cuda")
    alphas = torch.cumprod(1 - betas, dim=0)
    for i in range(steps):
        if i == steps - 1:
            mark_reset(torch, ctx)
        b, res = shapes[i % len(shapes)]
        x0 = torch.randn(b, 3, res, res, device="cuda")
        t = torch.randint(0, 1000, (b,), device="cuda")
        noise = torch.randn_like(x0)
        a = alphas[t].view(-1, 1, 1, 1)
        xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
        with torch.autocast("cuda", dtype=torch.float16):
            pred = model(xt, t)
            loss = F.mse_loss(pred.float(), noise)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        del x0, t, noise, a, xt, pred, loss
    torch.cuda.synchronize()
    return (model, opt, scaler, alphas)


def w_diffusion_wrapped(torch, ctx):
    torch.cuda.memory._record_memory_history(max_entries=10_000)
    ctx["history"] = "_record_memory_history(max_entries=10_000) before the first allocation"
    return diffusion_train(torch, ctx, 20, [(32, 64)])


def w_diffusion_multires_wrapped(torch, ctx):
    torch.cuda.memory._record_memory_history(max_entries=6000)
    ctx["history"] = "_record_memory_history(max_entries=6000) before the first allocation"
    return diffusion_train(torch, ctx, 16, [(48, 32), (32, 48), (24, 64), (40, 40)])


def w_gpt2_bf16_wrapped(torch, ctx):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.cuda.memory._record_memory_history(max_entries=4000)
    ctx["history"] = "_record_memory_history(max_entries=4000) before the first allocation"
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=512, n_head=8, n_positions=512, vocab_size=8192)
    model = GPT2LMHeadModel(cfg).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    lens = (128, 256, 192, 320)
    for i in range(12):
        if i == 11:
            mark_reset(torch, ctx)
        ids = torch.randint(0, cfg.vocab_size, (8, lens[i % 4]), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out, ids
    torch.cuda.synchronize()
    return (model, opt)


def w_lstm_expandable_warm(torch, ctx):
    nn = torch.nn
    torch.manual_seed(0)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16000, 512)
            self.rnn = nn.LSTM(512, 1024, num_layers=2, batch_first=True)
            self.head = nn.Linear(1024, 16000)

        def forward(self, x):
            return self.head(self.rnn(self.emb(x))[0])

    model = LM().cuda().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(seq):
        ids = torch.randint(0, 16000, (32, seq + 1), device="cuda")
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 16000), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(3):
        step(128)
    torch.cuda.synchronize()
    ctx["stats_at_start"] = figures(torch)
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history()
    ctx["history"] = "_record_memory_history() (defaults) after three warm-up steps and a peak reset"
    for seq in (96, 160, 128):
        step(seq)
    torch.cuda.synchronize()
    return (model, opt)


def mlp(torch, widths):
    nn = torch.nn
    layers = []
    for i, o in zip(widths, widths[1:]):
        layers += [nn.Linear(i, o), nn.GELU()]
    return nn.Sequential(*layers[:-1])


def w_cuda_graph_mlp(torch, ctx):
    torch.cuda.memory._record_memory_history()
    ctx["history"] = "_record_memory_history() (defaults), before the first allocation"
    torch.manual_seed(0)
    model = mlp(torch, (1024, 4096, 4096, 1024)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = torch.nn.MSELoss()
    static_x = torch.randn(256, 1024, device="cuda")
    static_y = torch.randn(256, 1024, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(static_x), static_y).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        static_loss = loss_fn(model(static_x), static_y)
        static_loss.backward()
        opt.step()
    ctx["graph_pool"] = list(g.pool())
    losses = []
    for i in range(5):
        static_x.copy_(torch.randn(256, 1024, device="cuda"))
        g.replay()
        losses.append(static_loss.detach().clone())
        with torch.no_grad():
            _ = model(torch.randn(384 + 64 * i, 1024, device="cuda"))
    del g, static_loss
    opt.zero_grad(set_to_none=True)
    for _ in range(2):
        x = torch.randn(512, 1024, device="cuda")
        loss_fn(model(x), torch.randn(512, 1024, device="cuda")).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x
    torch.cuda.synchronize()
    return (model, opt, static_x, static_y, losses)


def w_mempool_mlp(torch, ctx):
    torch.cuda.memory._record_memory_history()
    ctx["history"] = "_record_memory_history() (defaults), before the first allocation"
    torch.manual_seed(0)
    model = mlp(torch, (1024, 2048, 1024)).cuda().eval()
    pool = torch.cuda.MemPool()
    ctx["mempool_id"] = list(pool.id)
    kept = []
    with torch.no_grad():
        with torch.cuda.use_mem_pool(pool):
            for n in (3 << 20, 5 << 20, 700 << 10, 12 << 20):
                kept.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
            kept.append(model(torch.randn(128, 1024, device="cuda")))
        for b in (64, 256, 512):
            _ = model(torch.randn(b, 1024, device="cuda"))
        del kept[1]
        kept.append(torch.empty(2 << 20, dtype=torch.uint8, device="cuda"))
        kept.clear()
        del pool
        for b in (128, 1024):
            _ = model(torch.randn(b, 1024, device="cuda"))
    torch.cuda.synchronize()
    return (model,)


def w_compile_reduce_overhead(torch, ctx):
    torch.cuda.memory._record_memory_history()
    ctx["history"] = "_record_memory_history() (defaults), before the first allocation"
    torch.manual_seed(0)
    model = mlp(torch, (512, 2048, 2048, 512)).cuda().eval()
    cmodel = torch.compile(model, mode="reduce-overhead")
    outs = []
    with torch.no_grad():
        for i in range(6):
            x = torch.randn(256, 512, device="cuda")
            outs.append(cmodel(x).clone())
    torch.cuda.synchronize()
    return (model, cmodel, outs)


def w_resnet50_fraction(torch, ctx):
    import torchvision

    torch.cuda.memory._record_memory_history()
    ctx["history"] = "_record_memory_history() (defaults), before the first allocation"
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = (5 << 30) / total
    torch.cuda.set_per_process_memory_fraction(fraction)
    ctx["memory_fraction"] = fraction
    ctx["memory_fraction_bytes"] = int(fraction * total)
    ctx["memory_fraction_call"] = "torch.cuda.set_per_process_memory_fraction((5 << 30) / total)"
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = False
    model = torchvision.models.resnet50(weights=None).cuda().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    ooms = 0
    for b in (24, 48, 32, 52, 40, 52, 28, 44):
        try:
            x = torch.randn(b, 3, 160, 160, device="cuda")
            y = torch.randint(0, 1000, (b,), device="cuda")
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            del x, y, loss
        except torch.OutOfMemoryError:
            ooms += 1
    ctx["caught_ooms"] = ooms
    torch.cuda.synchronize()
    return (model, opt)


def w_settings_runtime(torch, ctx):
    import random

    torch.cuda.memory._record_memory_history()
    ctx["history"] = "_record_memory_history() (defaults), before the first allocation"
    rng = random.Random(7)
    live = []
    for i in range(400):
        if i == 200:
            torch.cuda.synchronize()
            ctx["settings_changed_after"] = last_entries(torch)
            torch.cuda.memory._set_allocator_settings(
                "max_split_size_mb:32,roundup_power2_divisions:4"
            )
            ctx["settings_changed_to"] = "max_split_size_mb:32,roundup_power2_divisions:4"
        if live and rng.random() < 0.45:
            live.pop(rng.randrange(len(live)))
        else:
            n = int(2 ** rng.uniform(10, 26))
            live.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    return (live,)


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
    fig["allocator_settings_in_snapshot"] = snap.get("allocator_settings")
    fig["segment_pool_ids"] = sorted(
        {tuple(s.get("segment_pool_id") or (0, 0)) for s in snap["segments"]}
    )
    if "reset_after" in fig:
        fig["reset_after_in_trace"] = [
            m is not None
            and any(
                all(e.get(k) == m[k] for k in ("action", "addr", "size", "time_us"))
                for e in tr
            )
            for m, tr in zip(fig["reset_after"], snap["device_traces"])
        ]
    with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb", compresslevel=9) as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)
    with open(os.path.join(out_dir, name + suffix + ".json"), "w") as f:
        json.dump(fig, f, indent=1, sort_keys=True, default=str)
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
    procs = {}
    for n in names:
        log = open(os.path.join(a.out, n + suffix + ".log"), "w")
        wenv = dict(env)
        confs = [c for c in (WORKLOAD_CONF.get(n), a.alloc_conf) if c]
        if confs:
            wenv["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(confs)
        procs[n] = subprocess.Popen(
            [sys.executable, __file__, "--out", a.out, "--worker", n, "--suffix", suffix],
            stdout=log, stderr=subprocess.STDOUT, env=wenv,
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
