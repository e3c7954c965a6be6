"""portattn under Hugging Face transformers: tiny random-weight models (Llama, Mistral,
Qwen2, Gemma 2) built from configs (no downloads) give transformers' own
``eager``/``sdpa`` logits within float32 noise, with padding on either side, sliding
windows, grouped-query heads and softcap, and generate the same tokens; the masks
reach portattn structured."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from portattn.testing.plugin import require_library

torch = require_library("torch")
try:
    transformers = importlib.import_module("transformers")
except ImportError as e:
    # the transformers tox env sets this: there a missing transformers fails the run
    if os.environ.get("PORTATTN_TEST_TRANSFORMERS") == "1":
        pytest.fail(f"transformers cannot be imported: {e}", pytrace=False)
    pytest.skip(f"transformers is not installed: {e}", allow_module_level=True)

import portattn_torch.transformers as hf  # noqa: E402

import portattn  # noqa: E402

ATOL = RTOL = 2e-5  # float32: the implementations sum in different orders

COMMON = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 128}


def llama():
    return transformers.LlamaConfig(**COMMON)


def mistral():
    return transformers.MistralConfig(**COMMON, sliding_window=5)


def qwen2():
    # the second layer slides, the first attends to everything before it
    return transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=4,
                                    max_window_layers=1)


def gemma2():
    return transformers.Gemma2Config(**COMMON, head_dim=16, sliding_window=4,
                                     attn_logit_softcapping=5.0,
                                     layer_types=["sliding_attention", "full_attention"])


MODELS = {"llama": (llama, transformers.LlamaForCausalLM, ("eager", "sdpa")),
          "mistral": (mistral, transformers.MistralForCausalLM, ("eager", "sdpa")),
          "qwen2": (qwen2, transformers.Qwen2ForCausalLM, ("eager", "sdpa")),
          # sdpa has no softcap
          "gemma2": (gemma2, transformers.Gemma2ForCausalLM, ("eager",))}


BANDS = {"llama": {"causal"}, "mistral": {"sliding_window"},
         "qwen2": {"causal", "sliding_window"},
         "gemma2": {"causal", "sliding_window"}}


@pytest.fixture(scope="module", autouse=True)
def registered():
    hf.register()


def build(name):
    config, cls, peers = MODELS[name]
    torch.manual_seed(0)
    cfg = config()
    cfg._attn_implementation = "eager"
    return cls(cfg).eval(), peers


@pytest.fixture
def kinds(monkeypatch):
    """The mask kinds of every portattn call the model makes."""
    seen = []
    attention = portattn.attention

    def spy(*args, mask=None, **kwargs):
        seen.append(None if mask is None else mask.kinds)
        return attention(*args, mask=mask, **kwargs)

    monkeypatch.setattr(portattn, "attention", spy)
    return seen


def logits(model, impl, ids, **kwargs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, **kwargs).logits


def padded_batch(length=14):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, COMMON["vocab_size"], (3, length), generator=g)
    attention_mask = torch.ones(3, length, dtype=torch.long)
    attention_mask[1, :5] = 0   # left padding
    attention_mask[2, -6:] = 0  # right padding
    return ids, attention_mask


@pytest.mark.parametrize("name", MODELS)
def test_logits_equal_transformers_own(name, kinds):
    model, peers = build(name)
    ids, attention_mask = padded_batch()
    ours = logits(model, "portattn", ids, attention_mask=attention_mask)
    real = attention_mask.bool()  # padded positions differ by convention (0 here)
    for peer in peers:
        torch.testing.assert_close(ours[real], logits(model, peer, ids,
                                                      attention_mask=attention_mask)[real],
                                   atol=ATOL, rtol=RTOL)
    assert kinds, "portattn was not called"
    assert all(k is not None and "dense" not in k and "key_ranges" in k for k in kinds)
    assert set().union(*kinds) - {"key_ranges"} == BANDS[name]


@pytest.mark.parametrize("name", MODELS)
def test_without_padding_the_mask_is_a_band(name, kinds):
    model, peers = build(name)
    ids, _ = padded_batch()
    torch.testing.assert_close(logits(model, "portattn", ids), logits(model, peers[0], ids),
                               atol=ATOL, rtol=RTOL)
    assert all(k <= {"causal", "sliding_window"} for k in kinds)


@pytest.mark.parametrize("cache", [None, "static"])
@pytest.mark.parametrize("name", MODELS)
def test_generate_token_for_token(name, cache):
    model, _ = build(name)
    ids, attention_mask = padded_batch(9)
    attention_mask[2] = 1  # generation pads on the left
    attention_mask[0, :2] = 0
    runs = {}
    for impl in ("eager", "portattn"):
        model.set_attn_implementation(impl)
        # a static cache makes generate() build the masks before each forward pass
        runs[impl] = model.generate(ids, attention_mask=attention_mask, max_new_tokens=10,
                                    do_sample=False, pad_token_id=0,
                                    cache_implementation=cache)
    assert runs["portattn"].shape == (3, 19)
    torch.testing.assert_close(runs["portattn"], runs["eager"], atol=0, rtol=0)


def test_packed_sequences_become_documents(kinds):
    model, _ = build("mistral")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, COMMON["vocab_size"], (1, 16), generator=g)
    # three documents of 6, 7 and 3 tokens in one row: position ids restart at 0
    position_ids = torch.cat([torch.arange(n) for n in (6, 7, 3)])[None]
    # transformers detects packing only without a cache (training)
    ours = logits(model, "portattn", ids, position_ids=position_ids, use_cache=False)
    torch.testing.assert_close(ours, logits(model, "eager", ids, position_ids=position_ids,
                                            use_cache=False), atol=ATOL, rtol=RTOL)
    assert all("documents" in k for k in kinds)
    alone = logits(model, "eager", ids[:, 6:13], position_ids=position_ids[:, 6:13],
                   use_cache=False)
    torch.testing.assert_close(ours[:, 6:13], alone, atol=ATOL, rtol=RTOL)


def test_dropout_in_training():
    model, _ = build("llama")
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    model.set_attn_implementation("portattn")
    model.train()
    ids, attention_mask = padded_batch()
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(model(ids, attention_mask=attention_mask).logits)
    torch.testing.assert_close(runs[0], runs[1])  # dropout draws from torch's generator
    model.eval()
    assert not torch.allclose(runs[0], logits(model, "portattn", ids,
                                              attention_mask=attention_mask))
    runs[0].sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_unknown_mask_functions_fall_back_to_transformers_dense_mask():
    from transformers import masking_utils as mu

    def odd_keys(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx % 2 == 1

    function = mu.and_masks(mu.causal_mask_function, odd_keys)
    got = hf.build_mask(2, 5, 5, mask_function=function)
    assert got.kinds == {"dense"}
    assert hf.build_mask(2, 5, 5, attention_mask=got) is got  # passed through
    want = mu.sdpa_mask(2, 5, 5, mask_function=function, allow_is_causal_skip=False)
    torch.testing.assert_close(got.parts_of("dense")[0].allowed, want)


def test_scattered_padding_is_a_dense_row_mask():
    attention_mask = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]])
    got = hf.build_mask(2, 4, 4, attention_mask=attention_mask)
    assert got.kinds == {"causal", "dense"}
    assert got.parts_of("dense")[0].allowed.shape == (2, 1, 1, 4)


def test_importing_the_plugin_does_not_import_transformers():
    code = ("import sys, portattn_torch; import portattn_torch._sdpa_kernel; "
            "assert 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("bidirectional", [True, False], ids=["encoder", "decoder"])
@pytest.mark.parametrize(("buckets", "max_distance"), [(32, 128), (64, 256), (8, 20)])
def test_t5_buckets_are_t5s_own(bidirectional, buckets, max_distance):
    from array_api_compat import array_namespace
    from transformers.models.t5.modeling_t5 import T5Attention

    from portattn import scores

    relative = torch.arange(-3000, 3000)
    theirs = T5Attention._relative_position_bucket(relative, bidirectional=bidirectional,
                                                   num_buckets=buckets,
                                                   max_distance=max_distance)
    ours = scores.t5_buckets(array_namespace(relative), relative,
                             bidirectional=bidirectional, num_buckets=buckets,
                             max_distance=max_distance)
    assert torch.equal(ours.long(), theirs)
