"""Trains a small character-level GPT twice with the same seed, once with torch.optim.AdamW and once
with optfuse.torch.AdamW, and plots both loss curves and the optimizer-step times.

    python3 examples/train_gpt.py [--steps 200] [--device cpu|cuda] [--out out/train_gpt.png]

Both runs see the same initial weights, the same batches, the same parameter groups (weight decay on
matrices only), the same warm-up + cosine learning-rate schedule and the same gradient clipping; only
the optimizer differs (torch.optim.AdamW with its defaults: the for-loop implementation on the CPU,
foreach on CUDA), so the two loss curves should lie on top of each other.

What it prints at the end, and what to expect: the largest absolute loss difference over all steps
(the curves coincide); the largest parameter difference after the last step, absolute and relative
to the largest parameter. One optfuse step equals torch's to float32 rounding (within 1e-6 of the
parameter scale; tests/python/test_torch_parity.py checks 20 steps), but training feeds each step's
rounding into the next step's gradients, so after hundreds of steps the parameters differ by more
than that. Then the median optimizer step time of each (the first step is left out: optfuse compiles
its kernel there, or loads it from the disk cache).
"""
import argparse
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import optfuse.torch

HERE = os.path.dirname(os.path.abspath(__file__))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, block, dim=64, layers=2, heads=4):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))


def param_groups(model, weight_decay):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def load_data(path):
    """The text at path as a tensor of character indices, and the sorted vocabulary."""
    text = open(path, encoding="utf-8").read()
    chars = sorted(set(text))
    return torch.tensor([chars.index(c) for c in text], dtype=torch.long), chars


def lr_schedule(opt, steps):
    """Linear warm-up over the first tenth of the steps, then cosine decay to zero at `steps`."""
    warmup = max(1, steps // 10)
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))


def get_batch(data, args, gen, device):
    """args.batch random windows of args.block characters (inputs) and the same shifted by one (targets)."""
    ix = torch.randint(len(data) - args.block - 1, (args.batch,), generator=gen)
    x = torch.stack([data[i:i + args.block] for i in ix]).to(device)
    y = torch.stack([data[i + 1:i + args.block + 1] for i in ix]).to(device)
    return x, y


def run(opt_cls, data, vocab, args, device, *, opt_kwargs=None, param_dtype=None, autocast_dtype=None):
    """Trains a fresh GPT (seeded by args.seed) for args.steps steps, yielding after each step.
    opt_kwargs: extra optimizer keywords; param_dtype: the dtype the model's weights are cast to
    (None: float32); autocast_dtype: forward and loss under torch.autocast in that dtype (None: no autocast)."""
    torch.manual_seed(args.seed)
    model = GPT(vocab, args.block).to(device)
    if param_dtype is not None:
        model = model.to(param_dtype)
    opt = opt_cls(param_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95), **(opt_kwargs or {}))
    sched = lr_schedule(opt, args.steps)
    gen = torch.Generator().manual_seed(args.seed)
    losses, times = [], []
    for step in range(args.steps):
        x, y = get_batch(data, args, gen, device)
        with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            logits = model(x)
            if autocast_dtype is not None:
                logits = logits.float()  # the loss in float32, whatever autocast chose for the logits
            loss = F.cross_entropy(logits.view(-1, vocab), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        sched.step()
        losses.append(loss.item())
        yield step, losses, times, model


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="out/train_gpt.png")
    ap.add_argument("--data", default=os.path.join(HERE, "data", "tiny_essays.txt"))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--block", type=int, default=48)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    data, chars = load_data(args.data)
    print(f"{len(data)} characters, vocabulary {len(chars)}, device {device}, {args.steps} steps")

    results = {}
    for name, cls in (("torch.optim.AdamW", torch.optim.AdamW), ("optfuse.torch.AdamW", optfuse.torch.AdamW)):
        print(f"-- {name}")
        for step, losses, times, model in run(cls, data, len(chars), args, device):
            if step % max(1, args.steps // 4) == 0 or step == args.steps - 1:
                print(f"  step {step:4d}  loss {losses[-1]:.4f}  optimizer step {times[-1]:.3f} ms")
        results[name] = (losses, times, model)

    (lt, tt, mt), (lo, to, mo) = results["torch.optim.AdamW"], results["optfuse.torch.AdamW"]
    print("\nstep  loss torch.optim.AdamW  loss optfuse.torch.AdamW")
    for s in range(0, args.steps, max(1, args.steps // 5)):
        print(f"{s:4d}  {lt[s]:.5f}               {lo[s]:.5f}")
    diff = max(abs(a - b) for a, b in zip(lt, lo))
    pdiff = max((a - b).abs().max().item() for a, b in zip(mt.parameters(), mo.parameters()))
    pscale = max(p.abs().max().item() for p in mt.parameters())
    med = lambda xs: sorted(xs[1:])[len(xs[1:]) // 2] if len(xs) > 1 else xs[0]  # noqa: E731 (first step compiles)
    print(f"\nfinal loss: torch {lt[-1]:.4f}, optfuse {lo[-1]:.4f}")
    print(f"largest loss difference over the {args.steps} steps: {diff:.2e} (absolute)")
    print(f"largest parameter difference after {args.steps} steps: {pdiff:.2e} absolute, {pdiff / pscale:.2e} "
          f"relative to the largest parameter ({pscale:.2f})")
    print("expected: one step equals torch's to float32 rounding (within 1e-6 of the parameter scale, "
          "tests/python/test_torch_parity.py);\n  training compounds those roundings step after step, so "
          f"after {args.steps} steps the parameters differ more than that, while the losses agree closely")
    print(f"median optimizer step: torch {med(tt):.3f} ms, optfuse {med(to):.3f} ms "
          f"(first optfuse step, which compiles the kernel or loads it from the cache: {to[0]:.1f} ms)")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.plot(lt, label="torch.optim.AdamW", lw=2.5, alpha=0.6)
    ax1.plot(lo, label="optfuse.torch.AdamW", lw=1, ls="--")
    ax1.set(xlabel="step", ylabel="training loss", title=f"char-level GPT on {os.path.basename(args.data)}")
    ax1.legend()
    ax2.plot(range(1, len(tt)), tt[1:], label="torch.optim.AdamW", lw=1)
    ax2.plot(range(1, len(to)), to[1:], label="optfuse.torch.AdamW", lw=1)
    ax2.set(xlabel="step", ylabel="optimizer step (ms)", yscale="log",
            title=f"optimizer step time on {device.type} (first step not shown)")
    ax2.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
