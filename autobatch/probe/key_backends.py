"""What else the cache keys a step by: process-wide kernel choices and tensor layouts.

Beside the model, the optimizer and the inputs (:mod:`~autobatch.probe.cache_key`), a step's
memory depends on which attention kernels ``scaled_dot_product_attention`` may use (with the
fused ones off it keeps its score matrix) and on whether 4-d tensors are stored channels-last
(convolutions pick other kernels and workspaces).
"""

from __future__ import annotations

import torch

__all__ = ["attention_backends", "layout_of"]


def attention_backends() -> dict[str, bool]:
    """Which ``scaled_dot_product_attention`` kernels are switched on (``enable_flash_sdp``,
    ``sdpa_kernel``; CPU and CUDA alike): with the fused ones off, attention keeps its score
    matrix, and a tenth of the batch fit in a test."""
    names = ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled", "cudnn_sdp_enabled")
    return {name: bool(getattr(torch.backends.cuda, name)()) for name in names if hasattr(torch.backends.cuda, name)}


def layout_of(tensor: torch.Tensor) -> dict[str, str]:
    """``{"layout": "channels_last"}`` for a 4-d tensor stored channels-last (convolutions pick
    other kernels and workspaces), else nothing: the keys of other tensors stay as they were."""
    last = tensor.dim() == 4 and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=torch.channels_last)
    return {"layout": "channels_last"} if last else {}
