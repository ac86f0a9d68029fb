"""Compile the attention kernels for sm_90 without a GPU and report what the compiler made.

    python benchmarks/inspect_sass.py [--dump DIR]              # the Triton forward's variants
    python benchmarks/inspect_sass.py --gluon fwd dq dkdv       # the warp-specialised Gluon kernels

Per variant: registers, spills, shared memory and a count of the SASS instructions that
decide speed (IGMMA = INT8 wgmma, QGMMA = FP8 wgmma, MUFU = exp2/log2, I2F/F2I/F2FP =
conversions, FMNMX/FFMA/FMUL/FADD = softmax arithmetic).  Needs only Triton (its
bundled ptxas and cuobjdump); the signature mirrors what the launcher passes on contiguous
inputs (last-dim strides specialised to 1, pointers and row strides 16-byte aligned).
``--gluon`` compiles each Gluon module's ``compile_for_sm90`` (P mode direct) instead;
their API is Triton 3.6's, so that needs the Triton the GPU machine runs.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fp4_inductor import formats as F  # noqa: E402
from fp4_inductor.kernels.triton import attention_fwd as K  # noqa: E402

GLUON = {"fwd": "attention_fwd", "dq": "attention_bwd_dq", "dkdv": "attention_bwd_dkdv", "fused": "attention_bwd_fused"}

OPS = ["IGMMA", "QGMMA", "HGMMA", "WARPGROUP", "MUFU", "I2F", "F2I", "F2FP", "FMNMX", "FFMA",
       "FMUL", "FADD", "IADD3", "PRMT", "SHF", "LOP3", "FSEL", "SEL", "SHFL", "BAR", "LDS", "STS", "LDL", "STL"]


def compile_variant(d, p_mode, causal, bias_mode, block_m, warps, stages, maxnreg=None, tma=True, perm=True,
                    options=None, out_dtype="bf16", windowed=False):
    names = K._fwd_kernel.arg_names
    ptr_types = {"Q": "*i8", "K": "*i8", "VT": "*fp8e4nv", "QS": "*fp32", "KS": "*fp32", "VS": "*fp32",
                 "RANGES": "*i32", "QDOC": "*i64", "KDOC": "*i64", "DOC_RANGES": "*i32",
                 "BIAS": "*fp32", "OUT": f"*{out_dtype}", "LSE": "*fp32", "ROW_REF": "*fp32"}
    head_dim = F.kernel_head_dim(d)
    tma = tma and head_dim == d  # padded head dims take the pointer path (the launcher's rule)
    if tma and not perm:
        ptr_types["K"] = f"tensordesc<i8[1, 1, {K.BLOCK_N}, {d}]>"
    if tma:
        ptr_types["VT"] = f"tensordesc<fp8e4nv[1, 1, {d}, {K.BLOCK_N}]>"
    unit = {"stride_qd", "stride_kd", "stride_vn", "stride_qsm", "stride_ksn", "stride_od", "stride_lm", "stride_bn"}
    if not bias_mode:
        unit.discard("stride_bn")
    constexprs = dict(D_QK=d, D_V=d, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim, BLOCK_M=block_m, BLOCK_N=K.BLOCK_N,
                      P_MODE=K._P_MODE_ID[p_mode], CAUSAL=causal, WINDOWED=causal and windowed, BIAS_MODE=bias_mode,
                      USE_TMA=tma, PERM_P=perm, EMULATE=False, LIFT=F.p_lift(p_mode), EMPTY_ROW=F.EMPTY_ROW_LOG2,
                      SKIP_MASKED=bias_mode == 1 and K.key_bias.TRITON_SKIPS_MASKED_TILES, DOCUMENTS=False,
                      **K.OPTIONS)
    constexprs.update(options or {})
    constexprs.update({n: 1 for n in unit})
    signature = {}
    attrs = {}
    for i, n in enumerate(names):
        if n in constexprs:
            signature[n] = "constexpr"
        elif n in ptr_types:
            signature[n] = ptr_types[n]
            if not ptr_types[n].startswith("tensordesc"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[n] = "i32"
            if n.startswith("stride_") and n not in ("stride_vsh", "stride_vsb", "stride_ksh", "stride_ksb",
                                                      "stride_qsh", "stride_qsb", "stride_lh", "stride_lb"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=K._fwd_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    opts = dict(num_warps=warps, num_stages=stages)
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def disassemble(cubin: bytes) -> tuple[str, int, int]:
    """SASS text, registers per thread and spill bytes, through Triton's bundled cuobjdump."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    spill = re.search(r"STACK:(\d+)", res)
    return sass, regs, int(spill.group(1)) if spill else 0


def count_ops(sass: str) -> collections.Counter:
    c = collections.Counter()
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)(\.[A-Z0-9_.]+)?", line)
        if m:
            c[m.group(1)] += 1
    return c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", help="write .ptx/.sass per variant into this folder")
    ap.add_argument("--d", type=int, nargs="*", default=[128, 64])
    ap.add_argument("--modes", nargs="*", default=list(F.P_MODES))
    ap.add_argument("--configs", nargs="*", default=None, help="BM,warps,stages ...")
    ap.add_argument("--bias", type=int, nargs="*", default=[0, 1, 2], help="bias modes")
    ap.add_argument("--causal", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--no-tma", action="store_true")
    ap.add_argument("--windowed", action="store_true", help="causal variants with a sliding window")
    ap.add_argument("--key-bias", action="store_true", help="Gluon kernels: with a key-padding bias row")
    ap.add_argument("--no-perm", action="store_true")
    ap.add_argument("--opt", nargs="*", default=[], help="NAME=0/1 kernel switches")
    ap.add_argument("--gluon", nargs="*", choices=sorted(GLUON), help="these Gluon kernels instead")
    args = ap.parse_args()
    print(f"{'variant':44s} regs stack   smem instr " + " ".join(f"{o:>5s}" for o in OPS))
    if args.gluon:
        import importlib

        for kernel, d, causal in itertools.product(args.gluon, args.d, args.causal):
            module = importlib.import_module(f"fp4_inductor.kernels.gluon.{GLUON[kernel]}")
            if d not in getattr(module, "HEAD_DIMS", (64, 128)):
                continue
            extra = {"windowed": True} if args.windowed and kernel == "fwd" and causal else {}
            if args.key_bias:
                extra["key_bias"] = True
            suffix = "".join(f"_{name}" for name in extra)
            report(f"gluon_{kernel}_d{d}_{'causal' if causal else 'full'}{suffix}",
                   lambda: module.compile_for_sm90(d, bool(causal), **extra), args.dump)
        return
    configs = [tuple(int(x) for x in c.split(",")) for c in args.configs] if args.configs else K.CONFIGS[:1]
    for d, mode, causal, bias, cfg in itertools.product(args.d, args.modes, args.causal, args.bias, configs):
        name = f"d{d}_{mode}_{'causal' if causal else 'full'}_bias{bias}_bm{cfg[0]}w{cfg[1]}s{cfg[2]}"
        if len(cfg) > 3:
            name += f"r{cfg[3]}"
        if args.no_tma:
            name += "_ptr"
        if args.windowed:
            name += "_window"
        if args.no_perm:
            name += "_noperm"
        for kv in args.opt:
            name += "_" + kv.replace("PV_SPLIT", "pv").replace("CVT_I2F", "i2f")
        opts = {kv.split("=")[0]: bool(int(kv.split("=")[1])) for kv in args.opt}
        report(name, lambda: compile_variant(d, mode, bool(causal), bias, *cfg, tma=not args.no_tma,
                                             perm=not args.no_perm, options=opts, windowed=args.windowed), args.dump)


def report(name: str, compile_fn, dump: str | None) -> None:
    """One row: registers, spill stack, shared memory, instructions and the counted ones."""
    try:
        ck = compile_fn()
    except Exception as err:  # report and continue: one failing variant should not hide the rest
        print(f"{name:44s} FAILED: {type(err).__name__}: {str(err)[:300]}")
        return
    sass, regs, spills = disassemble(ck.asm["cubin"])
    ops = count_ops(sass)
    print(f"{name:44s} {regs:4d} {spills:5d} {ck.metadata.shared:6d} {sum(ops.values()):5d} "
          + " ".join(f"{ops[o]:5d}" for o in OPS))
    ck.asm["sass"] = sass
    if dump:
        os.makedirs(dump, exist_ok=True)
        for ext in ("ptx", "sass", "ttgir"):
            with open(os.path.join(dump, f"{name}.{ext}"), "w") as f:
                f.write(str(ck.asm.get(ext, "")))


if __name__ == "__main__":
    main()
