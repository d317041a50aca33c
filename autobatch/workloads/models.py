"""Built-in models for the command line: an MLP, a small ResNet-style CNN and a small GPT.

They exist so that ``python -m autobatch probe`` has something real to probe on any machine,
with no downloads: written in plain torch, small by default (the CPU default probe takes
seconds) and scalable through their arguments (``model.layers=24 model.width=1024``). Each
maps a batch of inputs to logits: ``[B, *shape] -> [B, classes]`` for :class:`MLP` and
:class:`ResNetCNN`, ``[B, T] tokens -> [B, T, vocab]`` for :class:`GPT`.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from .. import checks

__all__ = ["MLP", "ResNetCNN", "GPT"]


class MLP(nn.Module):
    """Flatten, then ``layers`` hidden Linear+ReLU blocks of ``width``, then a classifier."""

    def __init__(self, in_shape: Sequence[int], num_classes: int, width: int = 256, layers: int = 2) -> None:
        super().__init__()
        if layers < 1 or width < 1:
            raise ValueError(f"MLP needs layers >= 1 and width >= 1, got layers={layers}, width={width}")
        in_shape = checks.positive_shape("MLP in_shape", in_shape)
        num_classes = checks.positive_int("MLP num_classes", num_classes)
        blocks: list[nn.Module] = [nn.Flatten()]
        features = math.prod(in_shape)
        for _ in range(layers):
            blocks += [nn.Linear(features, width), nn.ReLU()]
            features = width
        blocks.append(nn.Linear(features, num_classes))
        self.net = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class _BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a residual connection (ResNet's basic block)."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride=stride, bias=False), nn.BatchNorm2d(channels_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetCNN(nn.Module):
    """A small ResNet: a 3x3 stem, ``stages`` stages of ``blocks_per_stage`` basic blocks (each
    stage after the first halves the resolution and doubles the channels), global average
    pooling and a linear classifier. Images are ``[B, in_channels, H, W]`` of any size."""

    def __init__(
        self, in_channels: int, num_classes: int, width: int = 16, stages: int = 3, blocks_per_stage: int = 1
    ) -> None:
        super().__init__()
        if stages < 1 or blocks_per_stage < 1 or width < 1:
            raise ValueError("ResNetCNN needs width, stages and blocks_per_stage >= 1")
        for name, value in (("in_channels", in_channels), ("num_classes", num_classes)):
            checks.positive_int(f"ResNetCNN {name}", value)
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        blocks: list[nn.Module] = []
        channels = width
        for stage in range(stages):
            out = width * 2**stage
            for index in range(blocks_per_stage):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(_BasicBlock(channels, out, stride))
                channels = out
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.blocks(self.stem(x))
        return self.head(features.mean(dim=(2, 3)))


class _DecoderBlock(nn.Module):
    """Pre-norm causal self-attention and MLP, each with a residual connection."""

    def __init__(self, width: int, heads: int, mlp_ratio: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, mlp_ratio * width), nn.GELU(), nn.Linear(mlp_ratio * width, width), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """A decoder-only transformer: token and learned position embeddings, ``layers`` decoder
    blocks of ``width`` with ``heads`` heads, a final norm and a vocabulary head. Sequences
    may be shorter than ``max_seq_len``."""

    def __init__(
        self,
        vocab_size: int,
        max_seq_len: int,
        layers: int = 2,
        width: int = 128,
        heads: int = 4,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("max_seq_len", max_seq_len), ("layers", layers),
                            ("width", width), ("heads", heads), ("mlp_ratio", mlp_ratio)):
            checks.positive_int(f"GPT {name}", value)  # heads=0 was a ZeroDivisionError, a size <= 0 torch's error
        if width % heads:
            raise ValueError(f"GPT width={width} must be divisible by heads={heads}")
        self.max_seq_len = max_seq_len
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(max_seq_len, width)
        self.blocks = nn.ModuleList(_DecoderBlock(width, heads, mlp_ratio, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.max_seq_len:
            raise ValueError(f"sequence length {length} exceeds the model's max_seq_len={self.max_seq_len}")
        positions = torch.arange(length, device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
