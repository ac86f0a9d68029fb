"""Which forward kernel ``kernels.forward_kernel`` runs (CPU: the kernel modules are stand-ins)."""

from __future__ import annotations

import types

import pytest
import torch

from fp4_inductor import kernels


@pytest.fixture
def launched(monkeypatch):
    """Stand-in Gluon and Triton modules; returns the list of kernels called."""
    calls = []

    def module(family, name):
        def attention_forward(*args):
            calls.append(family)

        def supports(q, k, v_t, q_scale, bias, p_mode, lse, row_ref):
            return bias is None and k.shape[2] % 16 == 0

        return types.SimpleNamespace(attention_forward=attention_forward, supports=supports)

    monkeypatch.setattr(kernels, "_module", module)
    return calls


@pytest.mark.parametrize("p_mode,causal,nk,bias,expected", [
    ("direct", False, 4096, None, "gluon"),
    ("direct", False, 4080, None, "triton"),  # below GLUON_MIN_KEYS
    ("direct", True, 4096, None, "triton"),  # causal needs more keys
    ("direct", True, 8192, None, "gluon"),
    ("direct", False, 4096, torch.zeros(1), "triton"),  # outside the Gluon kernel's scope
    ("exp", False, 8192, None, "triton"),  # measured faster on Triton
    ("fp4", False, 8192, None, "triton"),
])
def test_forward_dispatch(launched, p_mode, causal, nk, bias, expected):
    q, k = torch.empty(1, 2, 64, 128), torch.empty(1, 2, nk, 128)
    rows = torch.empty(1, 2, 64)
    kernels._forward(q, k, k, rows, None, None, bias, causal, p_mode, q, rows, rows)
    assert launched == [expected]
