"""A windowed attention kernel as FlashAttention-4's (``backends.global_tokens.WindowKernels``),
dense in float64 on the inputs' device: the stand-in that tests the global-tokens composition
without FA4 (tests/unit/test_global_tokens.py, and on CUDA tests/gpu/test_routes_gpu.py)."""

from __future__ import annotations

import math

import torch

from flexattn_zoo.backends.global_tokens import WindowKernels


def dense_window_kernels(softcap: float = 0.0) -> WindowKernels:
    """A windowed kernel as FA4's: FA-style ``(left, right)`` (-1 unbounded), bottom-right aligned,
    grouped k/v heads; the backward from the ``out`` and ``lse`` it is given. Dense float64."""

    def scores(q, k, window):  # type: ignore[no-untyped-def]
        lq, lk = q.shape[2], k.shape[2]
        group = q.shape[1] // k.shape[1]
        x = torch.matmul(q.double(), k.double().repeat_interleave(group, 1).transpose(-1, -2)) / math.sqrt(
            q.shape[-1]
        )
        s = softcap * torch.tanh(x / softcap) if softcap else x
        i = torch.arange(lq, device=q.device).view(-1, 1) + (lk - lq)
        j = torch.arange(lk, device=q.device).view(1, -1)
        left, right = window
        seen = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if left >= 0:
            seen &= j >= i - left
        if right >= 0:
            seen &= j <= i + right
        return x, s.masked_fill(~seen, -math.inf)

    def forward(q, k, v, window):  # type: ignore[no-untyped-def]
        _, s = scores(q, k, window)
        group = q.shape[1] // k.shape[1]
        out = torch.matmul(torch.softmax(s, -1), v.double().repeat_interleave(group, 1))
        return out.to(q.dtype), torch.logsumexp(s, -1).to(torch.promote_types(q.dtype, torch.float32))

    def backward(dout, q, k, v, out, lse, window, g_lse):  # type: ignore[no-untyped-def]
        group = q.shape[1] // k.shape[1]
        x, s = scores(q, k, window)
        p = torch.exp(s - lse.double().unsqueeze(-1))
        g, ve = dout.double(), v.double().repeat_interleave(group, 1)
        rowsum = (g * out.double()).sum(-1, keepdim=True)
        if g_lse is not None:
            rowsum = rowsum - g_lse.double().unsqueeze(-1)
        ds = p * (torch.matmul(g, ve.transpose(-1, -2)) - rowsum)
        if softcap:
            ds = ds * (1 - torch.tanh(x / softcap) ** 2)
        scale = 1 / math.sqrt(q.shape[-1])
        dq = torch.matmul(ds, k.double().repeat_interleave(group, 1)) * scale
        dk = (torch.matmul(ds.transpose(-1, -2), q.double()) * scale).unflatten(1, (k.shape[1], group)).sum(2)
        dv = torch.matmul(p.transpose(-1, -2), g).unflatten(1, (k.shape[1], group)).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    return WindowKernels(forward, backward)
