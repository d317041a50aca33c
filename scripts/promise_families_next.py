"""Three more families for ``bench_promise.py`` (thirty-ninth session), none of which any rule of
the probe was tuned on: ``python scripts/bench_promise.py --no-cli --workloads maskrcnn,vitmae,ssm``.

- ``maskrcnn``: torchvision's Mask R-CNN (ResNet-50 FPN) at 512x512 with 1-5 boxes and their
  masks an image: the detector's data-dependent region sampling plus a mask head over 28x28 RoIs;
- ``vitmae``: a ``transformers`` ViT-MAE (ViT-B/16 encoder, 8-layer decoder) pre-trained at 224x224
  with 75 % of the patches masked at random: the encoder sees a quarter of the tokens, the decoder
  all of them, and the argsort/gather of the random masking runs in every step;
- ``ssm``: a Mamba-style selective state-space language model in plain torch (6 layers of 256, an
  8-wide state per channel, 512 tokens): a causal depthwise convolution, then a diagonal linear
  recurrence whose input-dependent decay is scanned in chunks of 64 tokens (cumulative sums in log
  space inside a chunk, a Python loop across chunks), so a step makes many large elementwise
  temporaries of ``batch x chunk x channels x state`` and frees them chunk by chunk.

Builders return ``(model, optimizer, loss_fn, make)`` as ``bench_promise.build`` expects; ``quick``
gives a CPU-sized stand-in of the same structure.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def maskrcnn(device: str, quick: bool):
    from torchvision.models.detection import maskrcnn_resnet50_fpn

    side = 128 if quick else 512
    model = maskrcnn_resnet50_fpn(weights=None, weights_backbone=None, num_classes=11, min_size=side,
                                  max_size=side, trainable_backbone_layers=5).to(device)

    def target(i: int) -> dict:
        boxes = 1 + i % 5
        corner = torch.rand(boxes, 2, device=device) * side * 0.6
        extent = 16 + torch.rand(boxes, 2, device=device) * side * 0.3
        box = torch.cat([corner, corner + extent], 1)
        masks = torch.zeros(boxes, side, side, dtype=torch.uint8, device=device)
        for k, (x0, y0, x1, y1) in enumerate(box.round().long().tolist()):
            masks[k, y0:y1, x0:x1] = 1
        return {"boxes": box, "labels": torch.randint(1, 11, (boxes,), device=device), "masks": masks}

    def make(b):
        return [torch.rand(3, side, side, device=device) for _ in range(b)], [target(i) for i in range(b)]

    def loss_fn(m, batch):
        return sum(m(list(batch[0]), list(batch[1])).values())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), loss_fn, make


def vitmae(device: str, quick: bool):
    from transformers import ViTMAEConfig, ViTMAEForPreTraining

    shape = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                 decoder_num_attention_heads=2, decoder_intermediate_size=64) if quick else {}
    config = ViTMAEConfig(**shape)  # the defaults: ViT-B/16 at 224, a 512-wide 8-layer decoder, mask ratio 0.75
    model = ViTMAEForPreTraining(config).to(device)
    side = config.image_size

    def make(b):
        return torch.randn(b, 3, side, side, device=device)

    def loss_fn(m, images):
        return m(pixel_values=images).loss
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), loss_fn, make


class SelectiveScan(torch.nn.Module):
    """One Mamba-style block: ``x -> in_proj -> (u, gate)``; ``u`` through a causal depthwise
    convolution and SiLU, then ``h_t = exp(dt_t * A) * h_{t-1} + dt_t * B_t * u_t`` (a diagonal state
    of ``state`` per channel, ``dt``, ``B`` and ``C`` computed from ``u``), ``y_t = C_t . h_t``, gated."""

    def __init__(self, width: int, state: int, chunk: int):
        super().__init__()
        inner = 2 * width
        self.norm = torch.nn.LayerNorm(width)
        self.in_proj = torch.nn.Linear(width, 2 * inner)
        self.conv = torch.nn.Conv1d(inner, inner, 4, groups=inner, padding=3)
        self.x_proj = torch.nn.Linear(inner, 1 + 2 * state)
        self.dt_proj = torch.nn.Linear(1, inner)
        self.log_a = torch.nn.Parameter(torch.log(torch.arange(1, state + 1).float() * 4 / state).repeat(inner, 1))
        self.out_proj = torch.nn.Linear(inner, width)
        self.state, self.chunk = state, chunk

    def forward(self, x):
        length = x.shape[1]
        u, gate = self.in_proj(self.norm(x)).chunk(2, dim=-1)
        u = F.silu(self.conv(u.transpose(1, 2))[..., :length].transpose(1, 2))
        dt_in, b, c = self.x_proj(u).split([1, self.state, self.state], dim=-1)
        dt = 0.01 * F.softplus(self.dt_proj(dt_in)).float()  # (B, L, D); small, as Mamba's, so exp(-log_p) stays finite
        decay = dt.unsqueeze(-1) * -self.log_a.exp().float()  # log of the per-step decay, (B, L, D, N)
        drive = (dt * u.float()).unsqueeze(-1) * b.float().unsqueeze(2)  # (B, L, D, N)
        h = torch.zeros_like(drive[:, 0])
        ys = []
        for start in range(0, length, self.chunk):  # within a chunk: h_t = P_t (h_0 + sum_s drive_s / P_s)
            log_p = decay[:, start:start + self.chunk].cumsum(1)
            inner = h.unsqueeze(1) + (drive[:, start:start + self.chunk] * (-log_p).exp()).cumsum(1)
            states = log_p.exp() * inner
            ys.append((states * c[:, start:start + self.chunk].float().unsqueeze(2)).sum(-1))
            h = states[:, -1]
        y = torch.cat(ys, 1).to(u.dtype) * F.silu(gate)
        return x + self.out_proj(y)


class SSMLM(torch.nn.Module):
    """A language model of :class:`SelectiveScan` blocks between an embedding and a tied head."""

    def __init__(self, vocab: int, width: int, layers: int, state: int, chunk: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(SelectiveScan(width, state, chunk) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        torch.nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.T


def ssm(device: str, quick: bool):
    vocab, width, layers, state, chunk, seq = (64, 16, 2, 4, 8, 32) if quick else (32000, 256, 6, 8, 64, 512)
    model = SSMLM(vocab, width, layers, state, chunk).to(device)

    def make(b):
        return torch.randint(0, vocab, (b, seq + 1), device=device)

    def loss_fn(m, tokens):
        logits = m(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), loss_fn, make


FAMILIES = {"maskrcnn": maskrcnn, "vitmae": vitmae, "ssm": ssm}
