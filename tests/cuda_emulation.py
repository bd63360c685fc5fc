"""CUDA's fused attention kernels emulated on CPU, to run the HF runner's CUDA code path without a GPU.

:class:`EmulatedCudaKernels` is a dispatch mode that computes
``_scaled_dot_product_flash_attention`` and
``_scaled_dot_product_efficient_attention`` in float64 on CPU, after checking
the inputs those kernels accept (one query head per key/value head; flash:
half precision, no bias; memory-efficient: a bias with unit last stride and
rows 16-element aligned). Like the kernels, it returns outputs in
``[B, N, H, D]`` memory seen as ``[B, H, N, D]``, and the memory-efficient
log-sum-exp padded to a multiple of 32 queries (the padding is NaN here, so
reading it shows). With ``cuda_branches()`` active, ``hf_attention`` takes
its CUDA branches for CPU tensors.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from genlm_backend.llm.hf import attention as hf_attention

_aten = torch.ops.aten


class EmulatedCudaKernels(TorchDispatchMode):
    """Computes CUDA's fused attention kernels on CPU; every other operation runs as usual. ``calls`` counts them."""

    def __init__(self):
        super().__init__()
        self.calls = {"flash": 0, "efficient": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._scaled_dot_product_efficient_attention.default:
            query, key, value, bias = args[:4]
            assert query.shape[1] == key.shape[1], "one query head per key/value head"
            if bias is not None:
                assert bias.stride(-1) == 1 and bias.stride(-2) % 16 == 0, bias.stride()
                assert bias.shape == (*query.shape[:3], key.shape[2]), bias.shape
            self.calls["efficient"] += 1
            output, lse = _attention(query, key, value, bias, kwargs["scale"])
            padded = lse.new_full((*lse.shape[:2], -(-lse.shape[2] // 32) * 32), float("nan"))
            padded[..., : lse.shape[2]] = lse
            return output, padded, torch.empty(()), torch.empty(())
        if func is _aten._scaled_dot_product_flash_attention.default:
            query, key, value = args[:3]
            assert query.shape[1] == key.shape[1], "one query head per key/value head"
            assert query.dtype in (torch.float16, torch.bfloat16), query.dtype
            self.calls["flash"] += 1
            output, lse = _attention(query, key, value, None, kwargs["scale"])
            empty = torch.empty(0)
            return output, lse, empty, empty, 0, 0, empty, empty, empty
        return func(*args, **kwargs)


def _attention(query, key, value, bias, scale):
    scores = query.double() @ key.double().transpose(-1, -2) * scale
    if bias is not None:
        scores = scores + bias.double()
    lse = scores.logsumexp(-1)
    output = (torch.exp(scores - lse[..., None]) @ value.double()).to(query.dtype)
    return output.transpose(1, 2).contiguous().transpose(1, 2), lse.float()


@contextlib.contextmanager
def cuda_branches():
    """While active, ``hf_attention`` picks its CUDA kernels for CPU tensors."""
    with mock.patch.object(hf_attention, "_device_kernels", lambda device: "cuda"):
        yield
