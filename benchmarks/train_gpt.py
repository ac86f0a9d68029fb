"""Convergence check: a small causal GPT trained from scratch, BF16 attention vs ours.

    python benchmarks/train_gpt.py [--steps 3000] [--arms bf16 fp8 fp8+bf16bwd fp8+fusedbwd fp4]

Text: the Python standard library's own source files (ships with every Python), as
bytes (vocabulary 256), the last 5 % held out.  Model: 6 layers, width 512, 8 heads of
64, causal SDPA attention, sequence 512.  Every arm starts from the same weights and sees
the same batches; only the attention backend differs (``torch.compile`` with Inductor's
default backend, or ``backend=fp4_inductor.backend(policy="always", fmt=...)``).
Writes benchmarks/results/convergence_<device>.json and .png: loss curves and the
final-loss gap to BF16.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import common  # noqa: F401  (puts the project root on sys.path, as the other benchmarks do)
import fp4_inductor
from fp4_inductor import kernels
from fp4_inductor.config import HYBRID

RESULTS = Path(__file__).parent / "results"
FUSED = "fp8+fusedbwd"  # the FP8 forward with the one-kernel FP8 backward (FP4ATTN_FUSED_BACKWARD=1)


def load_corpus(max_bytes: int) -> torch.Tensor:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width, bias=False)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width, bias=False), nn.GELU(), nn.Linear(4 * width, width, bias=False))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, n, c))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, seq: int):
        super().__init__()
        self.embed, self.pos = nn.Embedding(256, width), nn.Parameter(torch.randn(seq, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, 256, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batches(data: torch.Tensor, batch: int, seq: int, steps: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        window = torch.stack([data[s : s + seq + 1] for s in start.tolist()])
        yield window[:, :-1], window[:, 1:]


def train(arm: str, args, train_data, val_data, device, init_state) -> dict:
    torch._dynamo.reset()
    model = GPT(args.layers, args.width, args.heads, args.seq).to(device)
    model.load_state_dict(init_state)
    # fp8+bf16bwd: the FP8 forward with a BF16 backward at every site (the hybrid path);
    # fp8+fusedbwd: the FP8 forward with the one-kernel FP8 backward (main's adds its switch).
    path = "fp8" if arm == FUSED else arm
    options = dict(overrides=(("*", arm),)) if arm == HYBRID else dict(policy="always", fmt=path)
    backend = "inductor" if arm == "bf16" else fp4_inductor.backend(**options)
    step_fn = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    sites = []
    if arm != "bf16":  # the arm means nothing unless every attention site really runs low precision
        x0 = next(batches(train_data, args.batch, args.seq, 1, seed=1))[0].to(device)
        with amp:
            with fp4_inductor.configure(**options):
                sites = [(s.name, s.path) for s in fp4_inductor.explain(model, x0).sites]
        model.zero_grad(set_to_none=True)
        assert sites and all(site_path == path for _, site_path in sites), sites
    fused_launches = _count_fused_launches() if arm == FUSED and device.type == "cuda" else None
    curve, val_curve, step_ms = [], [], []
    progress = _progress(args.steps, arm)
    for step, (x, y) in enumerate(batches(train_data, args.batch, args.seq, args.steps, seed=1)):
        start = time.perf_counter()
        for group in opt.param_groups:  # linear warm-up, cosine decay
            warm = min(1.0, (step + 1) / 100)
            group["lr"] = args.lr * warm * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        with amp:
            loss = F.cross_entropy(step_fn(x.to(device)).float().flatten(0, 1), y.to(device).flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        curve.append(loss.item())  # .item() synchronizes: the step's wall time ends here
        step_ms.append((time.perf_counter() - start) * 1e3)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val_curve.append((step + 1, evaluate(step_fn, val_data, args, device, amp)))
        progress.update(1)
    progress.close()
    if arm == FUSED and device.type == "cuda":  # a refused or failed launch leaves the call to the two kernels
        assert fused_launches[0] == fused_launches[1] > 0, f"the one-kernel backward ran {fused_launches}"
    return {"train_loss": curve, "val_loss": val_curve, "sites": sites,
            "median_step_ms": statistics.median(step_ms[len(step_ms) // 10:])}


def _count_fused_launches() -> list[int]:
    """[launches of the one-kernel backward, backward calls that passed it its operands],
    counted from here on."""
    from fp4_inductor.kernels.gluon import attention_bwd_fused

    counts, launch, backward = [0, 0], attention_bwd_fused.fused_backward, kernels._backward

    def counted_launch(*args):
        counts[0] += 1
        return launch(*args)

    def counted_backward(*args, **kw):
        counts[1] += args[11].dtype == torch.int8  # ke: the forward's codes
        return backward(*args, **kw)

    attention_bwd_fused.fused_backward, kernels._backward = counted_launch, counted_backward
    return counts


@torch.no_grad()
def evaluate(model, data, args, device, amp) -> float:
    losses = []
    for x, y in batches(data, args.batch, args.seq, 8, seed=2):
        with amp:
            logits = model(x.to(device)).float()
        losses.append(F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten()).item())
    return sum(losses) / len(losses)


def _progress(total: int, label: str):
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=label)
    except ImportError:
        class Silent:
            def update(self, n):
                pass

            def close(self):
                pass

        return Silent()


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, run in doc["runs"].items():
        train_loss = torch.tensor(run["train_loss"])
        smooth = torch.nn.functional.avg_pool1d(train_loss[None, None], 25, 1).flatten() if len(train_loss) > 25 else train_loss
        ax.plot(range(len(smooth)), smooth, label=f"{arm} train", alpha=0.7)
        steps, vals = zip(*run["val_loss"])
        ax.plot(steps, vals, "o--", label=f"{arm} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(f"GPT {doc['config']['layers']}x{doc['config']['width']} on stdlib source, {doc['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--arms", nargs="+", default=["bf16", "fp8", HYBRID, "fp4"])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--corpus-bytes", type=int, default=20_000_000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = load_corpus(args.corpus_bytes)
    split = int(data.numel() * 0.95)
    torch.manual_seed(0)
    init_state = GPT(args.layers, args.width, args.heads, args.seq).state_dict()
    runs = {}
    for arm in args.arms:
        os.environ["FP4ATTN_FUSED_BACKWARD"] = "1" if arm == FUSED else "0"  # read when the backward is traced and run
        runs[arm] = train(arm, args, data[:split], data[split:], device, init_state)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    final = {arm: run["val_loss"][-1][1] for arm, run in runs.items()}
    doc = {
        "device": name,
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "corpus_bytes": data.numel(),
        # the low-precision backward: the sm_90 kernels, or the reference emulation elsewhere
        "backward": "kernels" if kernels.kernels_run_on(device) else "reference emulation",
        "final_val_loss": final,
        "gap_vs_bf16": {arm: (loss - final["bf16"]) / final["bf16"] for arm, loss in final.items()} if "bf16" in final else {},
        "runs": runs,
    }
    stem = args.out or str(RESULTS / f"convergence_{name.lower().replace(' ', '_')}")
    Path(stem).parent.mkdir(parents=True, exist_ok=True)
    Path(stem + ".json").write_text(json.dumps(doc, indent=1))
    plot(doc, Path(stem + ".png"))
    print(json.dumps({"final_val_loss": final, "gap_vs_bf16": doc["gap_vs_bf16"],
                      "median_step_ms": {arm: run["median_step_ms"] for arm, run in runs.items()}}, indent=1))


if __name__ == "__main__":
    main()
