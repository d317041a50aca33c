"""Model families beside ``bench_promise.py``'s own, none of which any rule of the probe was tuned
on: ``python scripts/bench_promise.py --no-cli --workloads deeplabv3,r3d18,mixtral,vae``.

- ``deeplabv3``: torchvision's DeepLabV3-ResNet50 segmentation model at 256x256 (a dict output with
  an auxiliary head, a per-pixel loss, dilated convolutions; BatchNorm after a global pooling, so
  a micro-batch of one cannot train);
- ``r3d18``: torchvision's R3D-18 video classifier on 16-frame 112x112 clips (3-D convolutions);
- ``mixtral``: a small Mixtral-style mixture-of-experts decoder (8 experts, 2 per token): each
  expert's share of the tokens, and so its activations, depends on the data;
- ``vae``: a convolutional variational autoencoder at 128x128 (a random draw in the forward, a
  reconstruction plus KL loss).

Each builder returns ``(model, optimizer, loss_fn, make)`` as ``bench_promise.build`` expects;
``quick`` gives a CPU-sized stand-in of the same structure.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def deeplabv3(device: str, quick: bool):
    from torchvision.models.segmentation import deeplabv3_mobilenet_v3_large, deeplabv3_resnet50

    build = deeplabv3_mobilenet_v3_large if quick else deeplabv3_resnet50
    model = build(weights=None, weights_backbone=None, num_classes=21, aux_loss=True).to(device)
    side = 64 if quick else 256

    def make(b):
        return (torch.randn(b, 3, side, side, device=device), torch.randint(0, 21, (b, side, side), device=device))

    def loss_fn(m, batch):
        out = m(batch[0])
        return F.cross_entropy(out["out"].float(), batch[1]) + 0.4 * F.cross_entropy(out["aux"].float(), batch[1])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), loss_fn, make


def r3d18(device: str, quick: bool):
    from torchvision.models.video import r3d_18

    model = r3d_18(num_classes=10).to(device)
    frames, side = (4, 32) if quick else (16, 112)

    def make(b):
        return (torch.randn(b, 3, frames, side, side, device=device), torch.randint(0, 10, (b,), device=device))

    def loss_fn(m, batch):
        return F.cross_entropy(m(batch[0]).float(), batch[1])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), loss_fn, make


def mixtral(device: str, quick: bool):
    from transformers import MixtralConfig, MixtralForCausalLM

    seq, vocab = (16, 64) if quick else (512, 32000)
    size = (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2) if quick else
            dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8))
    config = MixtralConfig(vocab_size=vocab, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=seq, **size)
    model = MixtralForCausalLM(config).to(device)

    def make(b):
        return torch.randint(0, vocab, (b, seq + 1), device=device)

    def loss_fn(m, tokens):
        logits = m(tokens[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), loss_fn, make


class ConvVAE(torch.nn.Module):
    """A convolutional VAE: four stride-2 convolutions down to a latent map, a reparameterised draw,
    four transposed convolutions back."""

    def __init__(self, width: int = 64, latent: int = 16):
        super().__init__()
        chans = [3, width, width * 2, width * 4, width * 8]
        down = [m for a, b in zip(chans, chans[1:]) for m in (torch.nn.Conv2d(a, b, 4, 2, 1), torch.nn.SiLU())]
        self.encoder = torch.nn.Sequential(*down, torch.nn.Conv2d(chans[-1], 2 * latent, 1))
        ups = [m for a, b in zip(chans[:0:-1], chans[-2::-1]) for m in (torch.nn.ConvTranspose2d(a, b, 4, 2, 1),
                                                                         torch.nn.SiLU())]
        self.decoder = torch.nn.Sequential(torch.nn.Conv2d(latent, chans[-1], 1), *ups[:-1])

    def forward(self, x):
        mean, log_var = self.encoder(x).chunk(2, dim=1)
        z = mean + torch.randn_like(mean) * (0.5 * log_var).exp()
        return self.decoder(z), mean, log_var


def vae(device: str, quick: bool):
    model = ConvVAE(*((8, 4) if quick else (64, 16))).to(device)
    side = 32 if quick else 128

    def make(b):
        return torch.rand(b, 3, side, side, device=device)

    def loss_fn(m, images):
        recon, mean, log_var = m(images)
        kl = -0.5 * (1 + log_var - mean.pow(2) - log_var.exp()).float().mean()
        return F.mse_loss(recon.float(), images) + 1e-3 * kl
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), loss_fn, make


FAMILIES = {"deeplabv3": deeplabv3, "r3d18": r3d18, "mixtral": mixtral, "vae": vae}
