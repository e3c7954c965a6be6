"""Continuous batching over portattn's paged cache (docs/recipes/serving.md): a tiny
random-weight transformers Llama serves 32 requests, at most 8 at once, each forward pass
packing prefill chunks of new requests with one token of each decoding request; every
request gets the tokens of transformers' own greedy ``generate()`` on its prompt alone,
a forked request shares its prompt's pages, and every page is free at the end."""

from __future__ import annotations

import importlib
import itertools
import os
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

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

import portattn  # noqa: E402
from portattn import masks  # noqa: E402

NAME = "portattn_paged"


@dataclass
class PagedBatch:
    """What one forward pass attends with: its packed tokens are ``counts[0]`` tokens of
    ``sequences[0]``, then ``counts[1]`` of ``sequences[1]``, ...; ``caches`` holds one
    :class:`portattn.PagedKVCache` per layer."""

    caches: list[Any]
    sequences: list[int]
    counts: list[int]


def paged_attention_forward(module: Any, query: Any, key: Any, value: Any,
                            attention_mask: Any, scaling: float | None = None,
                            dropout: float = 0.0, *, paged_batch: PagedBatch,
                            **kwargs: Any) -> tuple[Any, None]:
    """transformers' attention-function call, sent to the layer's paged cache: ``query
    (1, Hq, T, D)`` after RoPE, ``key`` and ``value (1, Hkv, T, D)``; returns ``(output
    (1, T, Hq, D), None)``."""
    cache = paged_batch.caches[module.layer_idx]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # packed (T, H, D)
    cache.append(paged_batch.sequences, k, v, paged_batch.counts)
    out = cache.attention(q, paged_batch.sequences, paged_batch.counts,
                          mask=masks.causal(), scale=scaling)
    return out[None], None


def no_mask(*args: Any, **kwargs: Any) -> None:
    """transformers' mask-interface call: no mask; the cache keeps sequences apart."""
    return None


@dataclass(eq=False)  # requests are equal only to themselves
class Request:
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    sequence: int = -1  # its id in every layer's cache, once admitted
    cached: int = 0  # tokens of prompt + output whose keys the cache holds

    @property
    def pending(self) -> list[int]:
        """Tokens to run through the model: the prompt's rest, or the last new token."""
        return (self.prompt + self.output)[self.cached:]


class Server:
    """Admits waiting requests while fewer than ``max_running`` run; each :meth:`step`
    is one forward pass of at most ``max_tokens`` tokens: one for each decoding
    request, then prefill chunks in admission order."""

    def __init__(self, model: Any, *, page_size: int = 4, max_running: int = 8,
                 max_tokens: int = 16) -> None:
        config = model.config
        head_dim = config.hidden_size // config.num_attention_heads
        self.model = model
        self.eos = model.generation_config.eos_token_id
        self.caches = [portattn.PagedKVCache.empty(page_size, config.num_key_value_heads,
                                                   head_dim, xp=torch, dtype=model.dtype)
                       for _ in range(config.num_hidden_layers)]
        self.max_running, self.max_tokens = max_running, max_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.log: list[tuple[int, int, int]] = []  # (running, prefill tokens, decodes)

    def submit(self, prompt: list[int], max_new_tokens: int) -> Request:
        request = Request(list(prompt), max_new_tokens)
        self.waiting.append(request)
        return request

    def fork(self, request: Request, max_new_tokens: int) -> Request:
        """Another sample of a running request, sharing the pages of its tokens."""
        twin = Request(request.prompt, max_new_tokens, list(request.output),
                       cached=request.cached)
        twin.sequence = _same([c.fork(request.sequence) for c in self.caches])
        self.running.append(twin)
        return twin

    def step(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            request = self.waiting.popleft()
            request.sequence = _same([c.add() for c in self.caches])
            self.running.append(request)
        budget, batch = self.max_tokens, []
        for request in sorted(self.running, key=lambda r: len(r.pending) > 1):
            n = min(len(request.pending), budget)
            if n:
                batch.append((request, n))
                budget -= n
        tokens = [t for r, n in batch for t in r.pending[:n]]
        positions = [p for r, n in batch for p in range(r.cached, r.cached + n)]
        counts = [n for _, n in batch]
        self.log.append((len(self.running), sum(n for r, n in batch if r.cached < len(r.prompt)),
                         sum(1 for r, _ in batch if r.cached >= len(r.prompt))))
        last = torch.tensor(list(itertools.accumulate(counts))) - 1
        paged_batch = PagedBatch(self.caches, [r.sequence for r, _ in batch], counts)
        with torch.no_grad():
            logits = self.model(torch.tensor([tokens]), position_ids=torch.tensor([positions]),
                                use_cache=False, logits_to_keep=last,
                                paged_batch=paged_batch).logits[0]
        for (request, n), row in zip(batch, logits, strict=True):
            request.cached += n
            if request.pending:  # a prefill chunk short of the prompt's end
                continue
            token = int(row.argmax())
            request.output.append(token)
            if len(request.output) == request.max_new_tokens or token == self.eos:
                for cache in self.caches:
                    cache.free(request.sequence)
                self.running.remove(request)

    def run(self) -> None:
        while self.waiting or self.running:
            self.step()

    @property
    def pages_in_use(self) -> list[int]:
        return [cache.pages_in_use for cache in self.caches]


def _same(ids: list[int]) -> int:
    assert len(set(ids)) == 1, ids  # every layer's cache numbers the sequences alike
    return ids[0]


@pytest.fixture(scope="module")
def model():
    transformers.AttentionInterface.register(NAME, paged_attention_forward)
    transformers.masking_utils.AttentionMaskInterface.register(NAME, no_mask)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(config).eval()


def generated(model, prompt, max_new_tokens):
    """transformers' own greedy generation on the prompt alone."""
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False)
    return out[0, len(prompt):].tolist()


def requests(count=32, seed=0):
    rng = random.Random(seed)
    return [([rng.randrange(97) for _ in range(rng.randint(3, 24))], rng.randint(1, 12))
            for _ in range(count)]


def test_continuous_batching_generates_what_generate_does(model):
    wanted = requests()
    expected = [generated(model, prompt, n) for prompt, n in wanted]
    model.set_attn_implementation(NAME)
    server = Server(model)
    served = [server.submit(prompt, n) for prompt, n in wanted]
    server.run()
    assert [r.output for r in served] == expected
    assert server.pages_in_use == [0, 0]
    # the loop did what it says: 8 at once, prefill and decodes in one pass, and a
    # prompt longer than a pass holds, so in chunks
    assert max(running for running, _, _ in server.log) == 8
    assert any(prefill and decodes for _, prefill, decodes in server.log)
    assert max(len(prompt) for prompt, _ in wanted) > server.max_tokens


def test_a_forked_request_shares_its_prompts_pages(model):
    prompt = random.Random(1).choices(range(97), k=13)  # 3 full pages, 1 part-filled
    expected = {n: generated(model, prompt, n) for n in (3, 9)}
    model.set_attn_implementation(NAME)
    server = Server(model)
    first = server.submit(prompt, 3)
    server.step()  # the prompt's prefill, and the first new token
    assert first.output == expected[3][:1]
    second = server.fork(first, 9)  # the same prompt sampled again
    assert server.pages_in_use == [4, 4]  # shared, nothing copied
    server.step()
    # both wrote their token into the part-filled page: one of them into a copy
    assert server.pages_in_use == [5, 5]
    while first in server.running:
        copies = pages(first.cached) + pages(second.cached)
        assert all(n < copies for n in server.pages_in_use)
        server.step()
    server.run()
    assert first.output == expected[3]
    assert second.output == expected[9]
    assert server.pages_in_use == [0, 0]


def pages(tokens, page_size=4):
    return -(-tokens // page_size)
