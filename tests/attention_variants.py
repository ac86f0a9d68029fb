"""Small attention modules, one per way users write attention (tests only)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

B, N, C, H = 2, 80, 256, 4  # head dim 64
D = C // H


class Projected(nn.Module):
    """x -> q, k, v in [B, H, N, D] (k/v with ``kv_heads``), attention, output projection."""

    def __init__(self, kv_heads: int = H, dtype=torch.float32):
        super().__init__()
        self.kv_heads = kv_heads
        self.q = nn.Linear(C, C, dtype=dtype)
        self.kv = nn.Linear(C, 2 * kv_heads * D, dtype=dtype)
        self.o = nn.Linear(C, C, dtype=dtype)

    def heads(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, H, D).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, D).permute(2, 0, 3, 1, 4).unbind(0)
        return q, k, v

    def forward(self, x, *extra):
        out = self.attend(*self.heads(x), *extra)
        return self.o(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], C))


class SdpaPlain(Projected):
    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


class SdpaCausal(Projected):
    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class SdpaCausalShortQuery(Projected):
    """Nq < Nkv with is_causal: SDPA aligns the mask top-left."""

    def attend(self, q, k, v):
        return torch.cat([F.scaled_dot_product_attention(q[:, :, :48], k, v, is_causal=True), q[:, :, 48:]], dim=2)


class SdpaScale(Projected):
    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, scale=0.2)


class SdpaGqa(Projected):
    def __init__(self):
        super().__init__(kv_heads=2)

    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


class SdpaBoolMask(Projected):
    def attend(self, q, k, v, keep):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


class SdpaAdditiveMask(Projected):
    def attend(self, q, k, v, additive):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=additive)


class SdpaDropoutEval(Projected):
    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0)


class MatmulDiv(Projected):
    def attend(self, q, k, v):
        w = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(D)
        return torch.matmul(w.softmax(dim=-1), v)


class Einsum(Projected):
    def attend(self, q, k, v):
        w = torch.einsum("bhqd,bhkd->bhqk", q, k) * D**-0.5
        return torch.einsum("bhqk,bhkd->bhqd", F.softmax(w, dim=-1), v)


class Bmm3d(Projected):
    def attend(self, q, k, v):
        q3, k3, v3 = (t.reshape(B * H, -1, D) for t in (q, k, v))
        w = torch.bmm(q3, k3.transpose(1, 2)) * D**-0.5
        return torch.bmm(torch.softmax(w, dim=-1), v3).view(B, H, -1, D)


class Baddbmm(Projected):
    """GPT-NeoX/Bloom style: the scale rides on baddbmm's alpha."""

    def attend(self, q, k, v):
        q3, k3, v3 = (t.reshape(B * H, -1, D) for t in (q, k, v))
        empty = torch.empty(B * H, q3.shape[1], k3.shape[1], dtype=q.dtype, device=q.device)
        w = torch.baddbmm(empty, q3, k3.transpose(1, 2), beta=0.0, alpha=D**-0.5)
        return torch.bmm(w.softmax(-1), v3).view(B, H, -1, D)


class PrescaledQuery(Projected):
    def attend(self, q, k, v):
        return (q * D**-0.5 @ k.transpose(-1, -2)).softmax(-1) @ v


class TensorScale(Projected):
    """GPT-2's old spelling: divide by a 0-d tensor."""

    def attend(self, q, k, v):
        w = q @ k.transpose(-1, -2)
        w = w / torch.full([], v.size(-1) ** 0.5, dtype=w.dtype, device=w.device)
        return w.softmax(-1) @ v


class AdditiveMask(Projected):
    def attend(self, q, k, v, additive):
        w = q @ k.transpose(-1, -2) * D**-0.5 + additive
        return w.softmax(-1) @ v


class WhereCausalBuffer(Projected):
    """GPT-2 eager of old: slice a boolean causal buffer, torch.where with finfo.min."""

    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(128, 128, dtype=torch.bool)).view(1, 1, 128, 128))

    def attend(self, q, k, v):
        n = q.shape[-2]
        w = q @ k.transpose(-1, -2) / D**0.5
        fill = torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype, device=w.device)
        w = torch.where(self.bias[:, :, :n, :n], w, fill)
        return w.softmax(-1) @ v


class MaskedFill(Projected):
    def attend(self, q, k, v, keep):
        w = (q @ k.transpose(-1, -2) * D**-0.5).masked_fill(~keep, float("-inf"))
        return w.softmax(-1) @ v


class SoftmaxFp32Cast(Projected):
    """bf16 model, softmax in fp32 then cast back, as HF Llama eager does."""

    def __init__(self):
        super().__init__(dtype=torch.bfloat16)

    def attend(self, q, k, v):
        w = torch.matmul(q, k.transpose(2, 3)) * D**-0.5
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(w, v)


class DropoutEval(Projected):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.0)

    def attend(self, q, k, v):
        w = (q @ k.transpose(-1, -2) * D**-0.5).softmax(-1)
        w = F.dropout(self.drop(w), p=0.1, training=False)
        return w @ v


class RepeatKv(Projected):
    """HF repeat_kv: expand + reshape, then plain attention over the repeated heads."""

    def __init__(self):
        super().__init__(kv_heads=2)

    @staticmethod
    def repeat_kv(x, n_rep):
        b, hkv, n, d = x.shape
        return x[:, :, None, :, :].expand(b, hkv, n_rep, n, d).reshape(b, hkv * n_rep, n, d)

    def attend(self, q, k, v):
        k, v = self.repeat_kv(k, 2), self.repeat_kv(v, 2)
        w = torch.matmul(q, k.transpose(2, 3)) * D**-0.5
        return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)


# ---- traps: look like attention, must stay exactly as written


class PermutedKey(Projected):
    """K^T built by one permute of a [B, N, H, D] tensor: not a transpose of the last two
    dims of any node, so not rewritten (pytorch issue 195320)."""

    def attend(self, q, k, v):
        k_bnhd = k.transpose(1, 2)
        w = q @ k_bnhd.permute(0, 2, 3, 1) * D**-0.5
        return w.softmax(-1) @ v


class SoftmaxOverQueries(Projected):
    def attend(self, q, k, v):
        return (q @ k.transpose(-1, -2) * D**-0.5).softmax(-2) @ v


class ProbabilitiesReturned(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Projected()

    def forward(self, x):
        q, k, v = self.inner.heads(x)
        w = (q @ k.transpose(-1, -2) * D**-0.5).softmax(-1)
        return (w @ v).sum() + w.mean()


class DropoutTraining(Projected):
    def attend(self, q, k, v):
        w = F.dropout((q @ k.transpose(-1, -2) * D**-0.5).softmax(-1), p=0.1, training=True)
        return w @ v


def extra_inputs(module: nn.Module) -> tuple:
    """The mask arguments a variant's ``attend`` takes."""
    keep = torch.rand(B, 1, 1, N) > 0.25
    keep[..., 0] = True
    name = type(module).__name__
    if name in ("SdpaBoolMask", "MaskedFill"):
        return (keep,)
    if name in ("SdpaAdditiveMask", "AdditiveMask"):
        return (torch.zeros(B, 1, 1, N).masked_fill(~keep, torch.finfo(torch.float32).min),)
    return ()


CAPTURED = [
    SdpaPlain, SdpaCausal, SdpaCausalShortQuery, SdpaScale, SdpaGqa, SdpaBoolMask, SdpaAdditiveMask,
    SdpaDropoutEval, MatmulDiv, Einsum, Bmm3d, Baddbmm, PrescaledQuery, TensorScale, AdditiveMask,
    WhereCausalBuffer, MaskedFill, SoftmaxFp32Cast, DropoutEval, RepeatKv,
]
# Each captured variant's attention as an SDPA call of the same semantics (itself where it
# calls SDPA): what tests run in low precision for a reference error.
SDPA_FORM = {
    **{v: SdpaPlain for v in (MatmulDiv, Einsum, Bmm3d, Baddbmm, PrescaledQuery, TensorScale, SoftmaxFp32Cast,
                              DropoutEval)},
    AdditiveMask: SdpaAdditiveMask, WhereCausalBuffer: SdpaCausal, MaskedFill: SdpaBoolMask, RepeatKv: SdpaGqa,
}
# Variants with a mask or a causal structure (an ignored one changes their result).
MASKED = {SdpaCausal, SdpaCausalShortQuery, SdpaBoolMask, SdpaAdditiveMask, AdditiveMask, WhereCausalBuffer,
          MaskedFill}
TRAPS = {
    PermutedKey: "key operand is not K.transpose(-2, -1)",
    SoftmaxOverQueries: "softmax is not over the last (key) dimension",
    ProbabilitiesReturned: "attention probabilities are used elsewhere",
    DropoutTraining: "dropout in training",
}
