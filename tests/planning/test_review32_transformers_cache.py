"""Transformers layers checkpointed by autobatch: a key/value cache handed over positionally, and the cache check's reads.

Found planning a tiny ``GPT2LMHeadModel`` (its default ``use_cache=True``) on a batch with a padding
``attention_mask`` under a budget that needs checkpointing: ``GPT2Model`` hands its blocks the cache
positionally, which the layers' protocol does not drop (it strips keywords only), so each block wrote its keys
again in the recompute, attended over twice the tokens, and backward failed ("The size of tensor a (32) must
match the size of tensor b (16)"): ``plan()`` raised it. And the planner's look for a cache in the model's
output read the field ``past_key_values``, which Transformers 5 answers with "`past_key_values`/`cache_params`
are deprecated. Use `cache` instead." in the user's log (BERT's plan showed it).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from autobatch.planning.checkpointing import enable_checkpointing
from autobatch.planning.own_checkpointing import _cache_held, own_checkpointing_hint
from test_review20_transformers_blocks import ProtocolLayer

WIDTH, TOKENS = 8, 6


class SelfAttention(ProtocolLayer):
    """GPT-2's block in small: keys appended to the cache it is given, scores over every cached key plus a mask
    of the batch's own tokens (a padding mask fixes the keys' length)."""

    def __init__(self) -> None:
        super().__init__()
        self.key, self.out = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x, cache=None, mask=None, use_cache=False):
        keys = self.key(x)
        if cache is not None:
            keys = cache[id(self)] = torch.cat([cache[id(self)], keys], 1) if id(self) in cache else keys
        scores = x @ keys.transpose(1, 2) + mask  # [n, T, T]: keys of the batch's T tokens
        return x + self.out(torch.softmax(scores, -1) @ keys)


class GPT2Like(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList(SelfAttention() for _ in range(3))

    def forward(self, x, mask):
        cache: dict = {}  # built in a training forward (config.use_cache True), handed over positionally
        for block in self.h:
            x = block(x, cache, mask, use_cache=True)
        return x.pow(2).mean()


def test_review32_a_cache_handed_to_a_layer_positionally_is_dropped_under_checkpointing():
    torch.manual_seed(0)
    plain = GPT2Like().double()
    wrapped = copy.deepcopy(plain)
    assert enable_checkpointing(wrapped).modules == ["h.0", "h.1", "h.2"]
    x = torch.randn(2, TOKENS, WIDTH, dtype=torch.float64)
    mask = torch.zeros(TOKENS, TOKENS, dtype=torch.float64)
    mask[:, -2:] = float("-inf")  # padding
    plain(x, mask).backward()
    wrapped(x, mask).backward()  # RuntimeError: the recompute's keys were 12 tokens long, the mask's 6
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
        assert torch.equal(a.grad, b.grad), name


class Output(dict):
    """A Transformers 5 ``ModelOutput`` as far as the cache check reads it: a lookup of the old field name warns."""

    def _old(self, key):
        if key == "past_key_values":
            raise AssertionError("read past_key_values: Transformers 5 logs a deprecation warning")
        return key

    def get(self, key, default=None):
        return super().get(self._old(key), default)

    def __getitem__(self, key):
        return super().__getitem__(self._old(key))

    def __contains__(self, key):
        return super().__contains__(self._old(key))


Output.__module__ = "transformers.modeling_outputs"


def test_review32_the_cache_check_reads_no_deprecated_field_of_a_transformers_output():
    assert _cache_held(Output(loss=torch.zeros(()))) is False  # BERT's output: no cache at all
    assert _cache_held(Output(cache=[(torch.ones(1), torch.ones(1))])) is True
    legacy = dict.__new__(Output)
    dict.__setitem__(legacy, "past_key_values", [(torch.ones(1), torch.ones(1))])  # Transformers 4's field name
    assert _cache_held(legacy) is True


class Renamed(GPT2Like):
    """Transformers 5.24: ``activation_checkpointing_*``, the ``gradient_checkpointing_*`` names deprecated."""

    def activation_checkpointing_disable(self) -> None:
        pass


def test_review32_a_model_that_checkpoints_itself_is_told_the_method_its_transformers_has():
    renamed, older = Renamed(), GPT2Like()
    renamed.h[0].gradient_checkpointing = older.h[0].gradient_checkpointing = True  # as the enable method sets it
    told = own_checkpointing_hint(["h.0"], renamed)
    assert "model.activation_checkpointing_disable()" in told and "gradient_checkpointing_disable" not in told
    assert "model.gradient_checkpointing_disable()" in own_checkpointing_hint(["h.0"], older)  # older versions


class CallProtocolLayer(nn.Module):
    """``GradientCheckpointingLayer`` as Transformers 5.17 (and 4.5x) has it: the protocol in ``__call__``,
    the class forward plain."""

    gradient_checkpointing = False
    _can_checkpoint_with_cache = False

    def __call__(self, *args, **kwargs):
        if self.gradient_checkpointing and self.training:
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
            if kwargs.get("past_key_values") is not None:
                kwargs["past_key_values"] = None
            return self._gradient_checkpointing_func(functools.partial(super().__call__, **kwargs), *args)
        return super().__call__(*args, **kwargs)


CallProtocolLayer.__name__ = CallProtocolLayer.__qualname__ = "GradientCheckpointingLayer"


class CallBlock(CallProtocolLayer):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, past_key_values=None, use_cache=False):
        if past_key_values is not None:  # a cache written in training: the protocol drops it
            past_key_values.append(x)
        return x + torch.tanh(self.inner(x))


@pytest.mark.parametrize("read_only_flag", [True, False])  # Transformers 5.17 has _can_checkpoint_with_cache, 4.5x not
def test_review32_a_layer_whose_protocol_is_in_call_is_recomputed(monkeypatch, read_only_flag):
    """Transformers 5.17 keeps ``GradientCheckpointingLayer``'s protocol in ``__call__``: running the class forward
    with the flag set (as for 5.2x's wrapped forward) checkpointed nothing, on an H200 a 12-layer Llama's layers
    ran once a step and held the same memory as without checkpointing. Now each layer is recomputed in backward,
    its cache keyword dropped, and the gradients are the plain model's."""
    if not read_only_flag:
        monkeypatch.delattr(CallProtocolLayer, "_can_checkpoint_with_cache")
    torch.manual_seed(0)
    plain = nn.Sequential(*[CallBlock() for _ in range(3)]).double()
    wrapped = copy.deepcopy(plain)
    calls: list[int] = []
    for block in wrapped:
        block.inner.register_forward_hook(lambda *_: calls.append(1))
    enable_checkpointing(wrapped, modules=["0", "1", "2"])
    x = torch.randn(4, WIDTH, dtype=torch.float64)
    cache: list = []

    def run(model):
        h = x
        for block in model:
            h = block(h, past_key_values=cache, use_cache=True)
        h.sum().backward()

    run(plain)
    cache.clear()
    run(wrapped)
    assert len(calls) == 6 and not cache  # three forwards, three recomputes; no cache written under checkpointing
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), wrapped.parameters()))


class OldLayer(nn.Module):
    """Transformers 4.46's ``LlamaDecoderLayer`` in small (no ``GradientCheckpointingLayer`` before 4.52): keys
    written to the cache it is given by keyword, scores over every cached key plus the batch's padding mask, the
    cache handed back when ``use_cache``, which the model reads."""

    def __init__(self) -> None:
        super().__init__()
        self.key, self.out = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x, mask=None, past_key_value=None, use_cache=False):
        keys = self.key(x)
        if past_key_value is not None:
            keys = past_key_value[id(self)] = torch.cat([past_key_value[id(self)], keys], 1) \
                if id(self) in past_key_value else keys
        x = x + self.out(torch.softmax(x @ keys.transpose(1, 2) + mask, -1) @ keys)
        return (x, past_key_value) if use_cache else (x,)


OldLayer.__module__ = "transformers.models.llama.modeling_llama"


class OldModel(nn.Module):
    def __init__(self, layer: type) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layer() for _ in range(3))

    def forward(self, x, mask):
        cache: dict = {}
        for layer in self.layers:
            outputs = layer(x, mask=mask, past_key_value=cache, use_cache=True)
            x, cache = outputs[0], outputs[1]  # 4.46's LlamaModel: next_decoder_cache = layer_outputs[1]
        self.cache = cache
        return x.pow(2).mean()


def _padded_run(layer: type) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    plain = OldModel(layer).double()
    wrapped = copy.deepcopy(plain)
    assert enable_checkpointing(wrapped).modules == ["layers.0", "layers.1", "layers.2"]
    x = torch.randn(2, TOKENS, WIDTH, dtype=torch.float64)
    mask = torch.zeros(TOKENS, TOKENS, dtype=torch.float64)
    mask[:, -2:] = float("-inf")  # padding
    for model in (plain, wrapped):
        model(x, mask).backward()
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
        assert torch.equal(a.grad, b.grad), name
    return plain, wrapped


def test_review32_an_old_transformers_layer_wrapped_from_outside_writes_its_cache_once():
    """Transformers 4.40-4.51: a layer wrapped generically got its cache keywords in the recompute too, wrote its
    keys again and attended over twice the tokens: a tiny LlamaForCausalLM or T5 (4.46.3) with a padding mask
    failed in backward ("The size of tensor a (32) must match the size of tensor b (16)"). The recompute drops the
    cache; the forward keeps it (4.46's LlamaModel reads it back from the layer's outputs)."""
    _, wrapped = _padded_run(OldLayer)
    assert all(keys.shape[1] == TOKENS for keys in wrapped.cache.values()) and len(wrapped.cache) == 3


class CallLayer(CallProtocolLayer, OldLayer):
    """Transformers 4.53's layer: ``GradientCheckpointingLayer`` with its protocol in ``__call__``, no
    ``_can_checkpoint_with_cache``, outputs read by ``use_cache`` as 4.53's ``T5Stack`` reads a ``T5Block``'s."""


def test_review32_a_layer_whose_protocol_is_in_call_keeps_use_cache_its_model_reads(monkeypatch):
    """4.53's T5Stack (its own flag off) indexed the outputs of a layer autobatch told ``use_cache=False``, which
    returned fewer: IndexError in the forward. ``use_cache`` is kept; the cache itself is still not written."""
    monkeypatch.delattr(CallProtocolLayer, "_can_checkpoint_with_cache")
    _, wrapped = _padded_run(CallLayer)
    assert wrapped.cache is None  # dropped under checkpointing, as the protocol does
