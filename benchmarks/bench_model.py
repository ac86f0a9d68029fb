"""End to end: what a user's model gets from ``backend="fp4attn"`` against ``torch.compile``'s
default, on unmodified models (random init, nothing downloaded).

    python benchmarks/bench_model.py                        # every workload, full configs (an H200)
    python benchmarks/bench_model.py --workloads prefill --seqs 4096 16384 --layers 8
    python benchmarks/bench_model.py --tiny                 # tiny configs, one variant each (the CPU test)

Workloads: ``prefill`` (HF ``LlamaForCausalLM`` with the Llama-3.1-8B configuration, B*S
tokens at each S, with the ``attention_mask`` that ``generate()`` passes and without one),
``train`` (forward, backward and an AdamW step at B = 1, with and without
``gradient_checkpointing_enable()``), ``flux`` (diffusers' ``FluxTransformer2DModel``, the
FLUX.1-dev configuration, one denoising step at 1024^2 and 2048^2) and ``wan``
(``WanTransformer3DModel``, Wan2.1-14B, 81 frames at 480p and 720p).  Backends, timed
interleaved in one process: ``inductor`` (the default), ``fp4attn`` under ``auto`` (what a
user gets), under ``always`` (every site in low precision) and with every site on
``bf16`` (what the rewrite gives without low precision: a causal mask run as SDPA's
``is_causal``).  Per point: median step time, tokens/s, the ratio to ``inductor``, the
output's rel-L2 against ``inductor``'s (inference), peak memory, compile time (apart),
attention's share of the ``inductor`` step and which SDPA kernels it ran (profiler),
and the ``auto`` policy's picks (``explain``).  JSON and PNG under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch

from common import RESULTS, environment

BACKENDS = ("inductor", "fp4attn-auto", "fp4attn-always", "fp4attn-bf16")
# Without torch.compile (on request, not by default): the model as is, and through
# fp4_inductor.patch() (HF's sdpa attention, diffusers' native backend) under a policy.
EAGER_BACKENDS = ("eager", "eager-fp4attn-auto", "eager-fp4attn-always")
# Kernel names that are attention in a profile: SDPA's backends, FlashAttention, ours.
ATTENTION_KERNELS = ("flash", "fmha", "cudnn", "sdpa", "attention", "_fwd_kernel", "_bwd_dkdv", "_bwd_dq",
                     "_fwd_ws", "dq_backward", "dkdv", "quantize")

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=131072)
LLAMA_TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096)
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
FLUX_TINY = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=32,
                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True,
                 axes_dims_rope=(8, 12, 12))
WAN_14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
               text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
# (latent frames, latent height, width): 81 frames -> 21; 480x832 and 720x1280 over the VAE's 8x
WAN_LATENTS = {"480p": (21, 60, 104), "720p": (21, 90, 160)}
WAN_TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=4,
                text_dim=32, freq_dim=32, ffn_dim=64, num_layers=1, rope_max_seq_len=64)


@dataclasses.dataclass
class Point:
    """One measured configuration: a model, its inputs and how to run one step."""

    workload: str
    label: str
    tokens: int
    make_model: object  # () -> nn.Module
    make_inputs: object  # () -> dict of keyword arguments
    train: bool = False
    checkpointing: bool = False


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _build(cls, *args, dtype, **kwargs):
    """A model with random weights made on the device itself (initialising a 12-14B model
    on the host takes minutes), in ``dtype`` but for the parameters that diffusers'
    ``from_pretrained`` keeps in float32 (``_keep_in_fp32_modules``: Wan's norms, say)."""
    with torch.device(_device()):
        model = cls(*args, **kwargs).to(dtype)
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    for name, param in model.named_parameters():
        if any(m in name.split(".") for m in keep):
            param.data = param.data.float()
    return model


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def llama_points(args, train: bool) -> list[Point]:
    import transformers

    base = LLAMA_TINY if args.tiny else LLAMA_8B
    layers = args.train_layers if train else args.layers

    def make():
        cfg = transformers.LlamaConfig(**base, num_hidden_layers=layers, attn_implementation="sdpa")
        return _build(transformers.LlamaForCausalLM, cfg, dtype=args.dtype)

    points = []
    for s in args.seqs if not train else args.train_seqs:
        b = 1 if train else max(args.tokens // s, 1)
        # tiny: one variant per workload (masked prefill, checkpointed training), for tests
        for masked in ((False,) if train else (True,) if args.tiny else (False, True)):
            def inputs(b=b, s=s, masked=masked):
                ids = torch.randint(0, base["vocab_size"], (b, s), device=_device())
                kwargs = {"input_ids": ids}
                if masked:  # what generate() passes for an unpadded batch
                    kwargs["attention_mask"] = torch.ones_like(ids)
                return kwargs

            for ckpt in (((True,) if args.tiny else (False, True)) if train else (False,)):
                label = f"S={s}" + (" mask" if masked else "") + (" ckpt" if ckpt else "")
                points.append(Point("train" if train else "prefill", label, b * s, make, inputs, train, ckpt))
    return points


def flux_points(args) -> list[Point]:
    from diffusers import FluxTransformer2DModel

    cfg = FLUX_TINY if args.tiny else FLUX_DEV
    sizes = (64,) if args.tiny else args.flux_sizes
    points = []
    for size in sizes:
        n, text = (size // 16) ** 2 if not args.tiny else size, 16 if args.tiny else 512

        def inputs(n=n, text=text):
            dev, dt = _device(), args.dtype
            return dict(hidden_states=torch.randn(1, n, cfg["in_channels"], device=dev, dtype=dt),
                        encoder_hidden_states=torch.randn(1, text, cfg["joint_attention_dim"], device=dev, dtype=dt),
                        pooled_projections=torch.randn(1, cfg["pooled_projection_dim"], device=dev, dtype=dt),
                        timestep=torch.tensor([0.5], device=dev, dtype=dt), img_ids=torch.zeros(n, 3, device=dev),
                        txt_ids=torch.zeros(text, 3, device=dev), guidance=torch.tensor([3.5], device=dev, dtype=dt),
                        return_dict=False)

        make = lambda: _build(FluxTransformer2DModel, dtype=args.dtype, **cfg)  # noqa: E731
        points.append(Point("flux", f"{size}^2 ({n}+{text} tokens)", n + text, make, inputs))
    return points


def wan_points(args) -> list[Point]:
    from diffusers import WanTransformer3DModel

    cfg = WAN_TINY if args.tiny else WAN_14B
    shapes = {"tiny": (3, 8, 8)} if args.tiny else {name: WAN_LATENTS[name] for name in args.wan_sizes}
    points = []
    for name, (f, h, w) in shapes.items():
        tokens = f * (h // 2) * (w // 2)

        def inputs(f=f, h=h, w=w):
            dev, dt = _device(), args.dtype
            return dict(hidden_states=torch.randn(1, cfg["in_channels"], f, h, w, device=dev, dtype=dt),
                        timestep=torch.tensor([500], device=dev),
                        encoder_hidden_states=torch.randn(1, 16 if args.tiny else 512, cfg["text_dim"], device=dev,
                                                          dtype=dt), return_dict=False)

        make = lambda: _build(WanTransformer3DModel, dtype=args.dtype, **cfg)  # noqa: E731
        points.append(Point("wan", f"{name} ({tokens} tokens)", tokens, make, inputs))
    return points


def _compiled(model, backend: str):
    import fp4_inductor

    if backend == "inductor":
        return torch.compile(model)
    if backend.startswith("eager"):
        return model if backend == "eager" else _patched(model, policy=backend.rsplit("-", 1)[1])
    if backend == "fp4attn-bf16":
        return torch.compile(model, backend=fp4_inductor.backend(overrides=(("*", "bf16"),)))
    return torch.compile(model, backend=fp4_inductor.backend(policy=backend.split("-")[1]))


def _patched(model, policy: str):
    import fp4_inductor

    def run(*args, **kwargs):
        with fp4_inductor.patch(), fp4_inductor.configure(policy=policy):
            return model(*args, **kwargs)
    return run


def _step_fn(model, compiled, point: Point, inputs: dict):
    if not point.train:
        def infer():
            with torch.no_grad():
                return compiled(**inputs)
        return infer
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

    def train():
        optimizer.zero_grad(set_to_none=True)
        logits = compiled(**inputs).logits
        logits.float().square().mean().backward()
        optimizer.step()
    return train


def _output(out) -> torch.Tensor:
    """The prediction in float32: a diffusers model's sample or a causal LM's logits."""
    return (out[0] if isinstance(out, tuple) else out.logits).float()


def _time(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def _attention_share(fn) -> tuple[float | None, list[str]]:
    """Attention kernels' share of one step's device time, and their names (CUDA only)."""
    if not torch.cuda.is_available():
        return None, []
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        _sync()
    total, attention, names = 0.0, 0.0, set()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total += e.device_time
            if any(k in e.name.lower() for k in ATTENTION_KERNELS):
                attention += e.device_time
                names.add(e.name[:80])
    return (attention / total if total else None), sorted(names)[:8]


def _auto_picks(model, inputs: dict, train: bool) -> list[dict]:
    import fp4_inductor

    with torch.set_grad_enabled(train):
        report = fp4_inductor.explain(model, **inputs, policy="auto")
    picks = {}
    for s in report.sites:
        key = (s.path, s.mask, s.predicted_speedup, s.reason)
        picks[key] = picks.get(key, 0) + 1
    return [{"path": p, "mask": m, "predicted_speedup": sp, "reason": r, "sites": n}
            for (p, m, sp, r), n in picks.items()]


def measure(point: Point, args, progress) -> dict:
    """Every backend on one point: compiled once each (timed apart), then ``reps`` rounds
    of one step per backend, interleaved."""
    torch.manual_seed(0)
    model = point.make_model()
    model.train(point.train)
    if point.checkpointing:
        model.gradient_checkpointing_enable()
    inputs = point.make_inputs()
    row = {"workload": point.workload, "point": point.label, "tokens": point.tokens, "backends": {}}
    try:
        row["auto_picks"] = _auto_picks(model, inputs, point.train)
    except Exception as err:  # reported, the timing still runs
        row["auto_picks"] = f"{type(err).__name__}: {err}"[:300]
    steps = {}
    torch._dynamo.reset()  # once: each backend's frames are cached apart and must stay compiled
    for backend in args.backends:
        compiled = _compiled(model, backend)
        fn = _step_fn(model, compiled, point, inputs)
        try:
            compile_s = _time(fn) + _time(fn)  # first calls: compile (and a recompile if any)
            steps[backend] = fn
            row["backends"][backend] = {"compile_s": compile_s, "times_s": []}
        except Exception as err:
            row["backends"][backend] = {"error": f"{type(err).__name__}: {err}"[:400]}
        progress.update(1)
    for _ in range(args.reps):
        for backend, fn in steps.items():
            row["backends"][backend]["times_s"].append(_time(fn))
    for backend, fn in steps.items():
        r = row["backends"][backend]
        r["median_s"] = statistics.median(r["times_s"])
        r["tokens_per_s"] = point.tokens / r["median_s"]
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            fn()
            r["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if not point.train and "inductor" in steps:  # the same inputs through each backend: how far from inductor's
        want = _output(steps["inductor"]())
        for backend, fn in steps.items():
            if backend != "inductor":
                got = _output(fn())
                row["backends"][backend]["output_rel_l2"] = ((got - want).norm() / want.norm()).item()
    base = row["backends"].get("inductor", {}).get("median_s")
    for r in row["backends"].values():
        if base and "median_s" in r:
            r["vs_inductor"] = base / r["median_s"]
    if "inductor" in steps:
        row["attention_share"], row["inductor_attention_kernels"] = _attention_share(steps["inductor"])
    return row


def plot(rows: list[dict], backends: list[str], path: str) -> None:
    """Each backend's speed against inductor's, per point (``backends``: those compared)."""
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        mine = [r for r in rows if r["workload"] == workload]
        width = 0.8 / len(backends)
        for offset, backend in enumerate(backends):
            ratios = [r["backends"].get(backend, {}).get("vs_inductor", 0.0) for r in mine]
            ax.bar([i + width * offset for i in range(len(mine))], ratios, width=width, label=backend)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(mine))], [r["point"] for r in mine], rotation=30,
                      ha="right")
        ax.set_title(workload)
        ax.set_ylabel("speed vs torch.compile (inductor)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workloads", nargs="*", default=["prefill", "train", "flux", "wan"],
                    choices=["prefill", "train", "flux", "wan"])
    ap.add_argument("--seqs", type=int, nargs="*", default=[2048, 4096, 8192, 16384, 32768], help="prefill lengths")
    ap.add_argument("--tokens", type=int, default=32768, help="prefill tokens per step (B * S)")
    ap.add_argument("--layers", type=int, default=32, help="Llama layers in prefill")
    ap.add_argument("--train-seqs", type=int, nargs="*", default=[4096, 8192, 16384])
    ap.add_argument("--train-layers", type=int, default=32, help="Llama layers in training (as many as fit)")
    ap.add_argument("--flux-sizes", type=int, nargs="*", default=[1024, 2048], help="Flux image sizes (pixels)")
    ap.add_argument("--wan-sizes", nargs="*", default=list(WAN_LATENTS), choices=list(WAN_LATENTS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--backends", nargs="*", default=list(BACKENDS), choices=BACKENDS + EAGER_BACKENDS,
                    help="inductor is the baseline every ratio is against; the eager ones run on request")
    ap.add_argument("--tiny", action="store_true", help="tiny configs (tests, CPU)")
    ap.add_argument("--out", default=None, help="JSON path (default: results/model_<device>.json)")
    args = ap.parse_args()
    args.dtype = torch.float32 if args.tiny and not torch.cuda.is_available() else torch.bfloat16
    if args.tiny:
        args.seqs, args.tokens, args.train_seqs = [s for s in args.seqs if s <= 64] or [32, 64], 128, [64]
        args.layers = args.train_layers = 2
    # transformers >= 5.25 sets module state inside each checkpointed layer: without this,
    # Dynamo runs those layers eagerly, under every backend alike (README, the training example).
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    from tqdm import tqdm

    points = []
    for workload in args.workloads:
        try:
            points += {"prefill": lambda: llama_points(args, False), "train": lambda: llama_points(args, True),
                       "flux": lambda: flux_points(args), "wan": lambda: wan_points(args)}[workload]()
        except ImportError as err:  # diffusers missing: recorded, not an error
            print(f"{workload}: not installed ({err})")
    env = environment()
    device = env.get("device", "cpu")
    out = args.out or os.path.join(RESULTS, f"model_{device.lower().replace(' ', '_')}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    config = {"layers": args.layers, "train_layers": args.train_layers, "tokens": args.tokens, "reps": args.reps,
              "tiny": args.tiny, "dtype": str(args.dtype)}
    rows = []
    with tqdm(total=len(points) * len(args.backends), desc="bench_model") as progress:
        for point in points:
            rows.append(measure(point, args, progress))
            with open(out, "w") as f:  # after each point: a long run cut short keeps what it measured
                json.dump({"environment": env, "config": config, "rows": rows}, f, indent=1, default=str)
    compared = [b for b in args.backends if b != "inductor"]
    plot(rows, compared, out.replace(".json", ".png"))
    print(f"\n{'workload':8s} {'point':28s} " + " ".join(f"{b:>20s}" for b in compared) + "  attention share")
    for r in rows:
        ratios = [r["backends"].get(b, {}).get("vs_inductor") for b in compared]
        share = r.get("attention_share")
        print(f"{r['workload']:8s} {r['point']:28s} " + " ".join(f"{x:19.3f}x" if x else f"{'-':>20s}" for x in ratios)
              + (f"  {share:.0%}" if share is not None else ""))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
