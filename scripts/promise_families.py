"""Model families beside ``bench_promise.py``'s own, none of which any rule of the probe was tuned
on: ``python scripts/bench_promise.py --no-cli --workloads deeplabv3,r3d18,mixtral,vae``.

- ``deeplabv3``: torchvision's DeepLabV3-ResNet50 segmentation model at 256x256 (a dict output with
  an auxiliary head, a per-pixel loss, dilated convolutions; BatchNorm after a global pooling, so
  a micro-batch of one cannot train);
- ``r3d18``: torchvision's R3D-18 video classifier on 16-frame 112x112 clips (3-D convolutions);
- ``mixtral``: a small Mixtral-style mixture-of-experts decoder (8 experts, 2 per token): each
  expert's share of the tokens, and so its activations, depends on the data;
- ``vae``: a convolutional variational autoencoder at 128x128 (a random draw in the forward, a
  reconstruction plus KL loss);
- ``fasterrcnn``: torchvision's Faster R-CNN (ResNet-50 FPN) at 512x512, trained as its users do:
  ``model(images, targets)`` on a batch of two lists (the images, and per-image dicts of 1-5 boxes
  and labels), the sum of its dict of losses; its region sampling draws at random, so its memory
  moves from step to step;
- ``unet``: a diffusion-style U-Net at 64x64 (GroupNorm residual blocks with a timestep embedding,
  self-attention at 16x16 and 8x8, skip connections), trained to predict the noise at a random
  timestep;
- ``lora_llama``: LoRA fine-tuning of a Llama-style causal LM (``transformers``, 8 layers of 1024,
  512 tokens): the base frozen in bf16, rank-16 adapters on the attention's query and value
  projections the only trained parameters, so the optimizer state is small and the activations
  (the logits' float copy among them) are nearly all of the step (``LORA_USE_CACHE=0``/``1``
  passes ``use_cache`` to its forward; unset, the model's default, which builds a key-value cache);
- ``wav2vec2``: a ``transformers`` Wav2Vec2 speech model trained with CTC on 2 s of 16 kHz audio
  (a convolutional feature encoder over the raw samples, then 12 transformer layers);
- ``clip``: a ``transformers`` CLIP dual encoder (ViT-B/32 over 224x224 images, a 12-layer text
  encoder over 77 tokens) trained with its contrastive loss, whose logits are batch x batch: two
  towers in one step, and a loss term that grows with the square of the batch;
- ``whisper``: a ``transformers`` Whisper encoder-decoder (whisper-base's shape: 6 + 6 layers of 512)
  trained on 30 s of 80-bin log-mel features (two convolutions over 3000 frames, 1500 positions)
  against 64 label tokens: cross-attention from a short decoder over a long encoder;
- ``segformer``: a ``transformers`` SegFormer (MiT-b2's widths and depths) for 150-class semantic
  segmentation at 512x512: a hierarchical encoder whose attention reduces its keys spatially, an
  all-MLP decoder, and a loss over logits upsampled to the full image.

Each builder returns ``(model, optimizer, loss_fn, make)`` as ``bench_promise.build`` expects;
``quick`` gives a CPU-sized stand-in of the same structure.
"""

from __future__ import annotations

import os

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


def fasterrcnn(device: str, quick: bool):
    from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_fpn, fasterrcnn_resnet50_fpn

    side = 128 if quick else 512
    build = fasterrcnn_mobilenet_v3_large_fpn if quick else fasterrcnn_resnet50_fpn
    model = build(weights=None, weights_backbone=None, num_classes=11, min_size=side, max_size=side).to(device)

    def target(i: int) -> dict:
        boxes = 1 + i % 5
        corner = torch.rand(boxes, 2, device=device) * side * 0.6
        extent = 16 + torch.rand(boxes, 2, device=device) * side * 0.3
        return {"boxes": torch.cat([corner, corner + extent], 1), "labels": torch.randint(1, 11, (boxes,), device=device)}

    def make(b):
        return [torch.rand(3, side, side, device=device) for _ in range(b)], [target(i) for i in range(b)]

    def loss_fn(m, batch):
        return sum(m(list(batch[0]), list(batch[1])).values())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), loss_fn, make


class _Block(torch.nn.Module):
    """A U-Net residual block: GroupNorm, SiLU, convolution, the timestep added, twice."""

    def __init__(self, a: int, b: int, embed: int):
        super().__init__()
        self.norm1, self.conv1 = torch.nn.GroupNorm(8, a), torch.nn.Conv2d(a, b, 3, padding=1)
        self.time = torch.nn.Linear(embed, b)
        self.norm2, self.conv2 = torch.nn.GroupNorm(8, b), torch.nn.Conv2d(b, b, 3, padding=1)
        self.skip = torch.nn.Conv2d(a, b, 1) if a != b else torch.nn.Identity()

    def forward(self, x, t):
        h = self.conv1(F.silu(self.norm1(x))) + self.time(t)[:, :, None, None]
        return self.skip(x) + self.conv2(F.silu(self.norm2(h)))


class _Attention(torch.nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.norm, self.attn = torch.nn.GroupNorm(8, c), torch.nn.MultiheadAttention(c, 4, batch_first=True)

    def forward(self, x):
        b, c, h, w = x.shape
        seq = self.norm(x).flatten(2).transpose(1, 2)
        return x + self.attn(seq, seq, seq, need_weights=False)[0].transpose(1, 2).reshape(b, c, h, w)


class UNet(torch.nn.Module):
    """A diffusion U-Net: down through ``widths`` (attention at the last two levels), up with skips."""

    def __init__(self, widths=(64, 128, 256, 256), embed: int = 256):
        super().__init__()
        self.embed = torch.nn.Sequential(torch.nn.Linear(1, embed), torch.nn.SiLU(), torch.nn.Linear(embed, embed))
        self.stem = torch.nn.Conv2d(3, widths[0], 3, padding=1)
        self.down = torch.nn.ModuleList(_Block(a, b, embed) for a, b in zip(widths, widths[1:]))
        self.up = torch.nn.ModuleList(_Block(2 * b, a, embed) for a, b in zip(widths, widths[1:]))
        levels = len(widths) - 1
        self.attn = torch.nn.ModuleList(_Attention(b) if i >= levels - 2 else torch.nn.Identity()
                                        for i, b in enumerate(widths[1:]))
        self.out = torch.nn.Conv2d(widths[0], 3, 3, padding=1)

    def forward(self, x, t):
        t, h, skips = self.embed(t[:, None]), self.stem(x), []
        for block, attn in zip(self.down, self.attn):
            h = attn(block(h, t))
            skips.append(h)
            h = F.avg_pool2d(h, 2)
        for block, skip in zip(reversed(self.up), reversed(skips)):
            h = block(torch.cat([F.interpolate(h, scale_factor=2.0), skip], 1), t)
        return self.out(F.silu(h))


def unet(device: str, quick: bool):
    model = UNet(*(((16, 32, 32), 32) if quick else ())).to(device)
    side = 16 if quick else 64

    def make(b):
        return torch.rand(b, 3, side, side, device=device) * 2 - 1

    def loss_fn(m, images):
        t = torch.rand(images.shape[0], device=images.device)
        noise = torch.randn_like(images)
        noisy = (1 - t).sqrt()[:, None, None, None] * images + t.sqrt()[:, None, None, None] * noise
        return F.mse_loss(m(noisy, t).float(), noise)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), loss_fn, make


class LoRA(torch.nn.Module):
    """``base(x)`` plus a trained low-rank update ``x A^T B^T * alpha / rank`` (``B`` starts at 0)."""

    def __init__(self, base: torch.nn.Linear, rank: int = 16, alpha: float = 32.0):
        super().__init__()
        self.base, self.scale = base, alpha / rank
        device = base.weight.device
        self.a = torch.nn.Parameter(torch.randn(rank, base.in_features, device=device) / base.in_features ** 0.5)
        self.b = torch.nn.Parameter(torch.zeros(base.out_features, rank, device=device))

    def forward(self, x):
        return self.base(x) + (x @ self.a.t().to(x.dtype)) @ self.b.t().to(x.dtype) * self.scale


def lora_llama(device: str, quick: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    width, layers, vocab, seq = (64, 2, 256, 32) if quick else (1024, 8, 32000, 512)
    config = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=width * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=max(4, width // 64),
                         num_key_value_heads=max(4, width // 64), max_position_embeddings=seq)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoRA(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRA(layer.self_attn.v_proj)
    trained = [p for p in model.parameters() if p.requires_grad]

    def make(b):
        return torch.randint(0, vocab, (b, seq), device=device)

    cache = {} if os.environ.get("LORA_USE_CACHE") is None else {"use_cache": os.environ["LORA_USE_CACHE"] == "1"}

    def loss_fn(m, ids):
        return m(input_ids=ids, labels=ids, **cache).loss
    return model, torch.optim.AdamW(trained, lr=1e-4), loss_fn, make


def wav2vec2(device: str, quick: bool):
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    config = Wav2Vec2Config(vocab_size=32, **({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                               "intermediate_size": 128, "conv_dim": (32,) * 7} if quick else {}))
    model = Wav2Vec2ForCTC(config).to(device)
    samples, labels = (4000, 8) if quick else (32000, 40)

    def make(b):
        return (torch.randn(b, samples, device=device), torch.randint(1, 32, (b, labels), device=device))

    def loss_fn(m, batch):
        return m(input_values=batch[0], labels=batch[1]).loss
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), loss_fn, make


def clip(device: str, quick: bool):
    from transformers import CLIPConfig, CLIPModel

    text, vision = ({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "vocab_size": 256}, {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                          "num_attention_heads": 2, "image_size": 32, "patch_size": 8}) if quick else ({}, {})
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision)).to(device)
    side, tokens, vocab = (32, 16, 256) if quick else (224, 77, 49408)

    def make(b):
        return (torch.randn(b, 3, side, side, device=device), torch.randint(0, vocab, (b, tokens), device=device))

    def loss_fn(m, batch):
        return m(pixel_values=batch[0], input_ids=batch[1], return_loss=True).loss
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), loss_fn, make


def whisper(device: str, quick: bool):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    shape = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                 encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=100, vocab_size=512, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2, decoder_start_token_id=1) if quick else dict(
        d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8, decoder_attention_heads=8,
        encoder_ffn_dim=2048, decoder_ffn_dim=2048)
    config = WhisperConfig(**shape)
    model = WhisperForConditionalGeneration(config).to(device)
    frames, labels = config.max_source_positions * 2, 8 if quick else 64

    def make(b):
        return (torch.randn(b, config.num_mel_bins, frames, device=device),
                torch.randint(0, config.vocab_size, (b, labels), device=device))

    def loss_fn(m, batch):
        return m(input_features=batch[0], labels=batch[1]).loss
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), loss_fn, make


def segformer(device: str, quick: bool):
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    config = SegformerConfig(num_labels=150, **({"hidden_sizes": [16, 32, 64, 128], "decoder_hidden_size": 64}
                                                if quick else {"hidden_sizes": [64, 128, 320, 512], "depths": [3, 4, 6, 3],
                                                               "decoder_hidden_size": 768}))
    model = SegformerForSemanticSegmentation(config).to(device)
    side = 64 if quick else 512

    def make(b):
        return torch.randn(b, 3, side, side, device=device), torch.randint(0, 150, (b, side, side), device=device)

    def loss_fn(m, batch):
        return m(pixel_values=batch[0], labels=batch[1]).loss
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), loss_fn, make


FAMILIES = {"deeplabv3": deeplabv3, "r3d18": r3d18, "mixtral": mixtral, "vae": vae, "fasterrcnn": fasterrcnn,
            "unet": unet, "lora_llama": lora_llama, "wav2vec2": wav2vec2, "clip": clip,
            "whisper": whisper, "segformer": segformer}

from promise_families_next import FAMILIES as _NEXT  # noqa: E402  (maskrcnn, vitmae, ssm)

FAMILIES.update(_NEXT)
