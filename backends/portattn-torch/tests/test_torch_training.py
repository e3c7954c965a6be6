"""A small causal transformer trains the same with portattn as with torch's SDPA."""

from __future__ import annotations

import math

import pytest

from portattn.testing.plugin import require_library

torch = require_library("torch")

import portattn  # noqa: E402
from portattn import masks  # noqa: E402

VOCAB, D_MODEL, HEADS, KV_HEADS, SEQ, BATCH, STEPS = 16, 32, 4, 2, 24, 8, 50


def sdpa_attention(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                            enable_gqa=True)


def portattn_attention(kernel=None):
    def attend(q, k, v):
        return portattn.attention(q, k, v, mask=masks.causal(), kernel=kernel)
    return attend


class Block(torch.nn.Module):
    def __init__(self, attend):
        super().__init__()
        self.attend = attend
        head = D_MODEL // HEADS
        self.norm1, self.norm2 = torch.nn.LayerNorm(D_MODEL), torch.nn.LayerNorm(D_MODEL)
        self.q = torch.nn.Linear(D_MODEL, D_MODEL)
        self.kv = torch.nn.Linear(D_MODEL, 2 * KV_HEADS * head)
        self.out = torch.nn.Linear(D_MODEL, D_MODEL)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(D_MODEL, 4 * D_MODEL),
                                       torch.nn.GELU(), torch.nn.Linear(4 * D_MODEL, D_MODEL))

    def forward(self, x):
        b, n, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, n, HEADS, -1).transpose(1, 2)
        k, v = self.kv(h).view(b, n, 2, KV_HEADS, -1).permute(2, 0, 3, 1, 4)
        a = self.attend(q, k, v).transpose(1, 2).reshape(b, n, D_MODEL)
        x = x + self.out(a)
        return x + self.mlp(self.norm2(x))


class Model(torch.nn.Module):
    def __init__(self, attend):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D_MODEL)
        self.pos = torch.nn.Parameter(torch.randn(SEQ - 1, D_MODEL) / math.sqrt(D_MODEL))
        self.blocks = torch.nn.Sequential(Block(attend), Block(attend))
        self.head = torch.nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens) + self.pos))


def losses(attend):
    """Train on "repeat the first half, then count on": the loss of every step."""
    torch.manual_seed(0)
    model = Model(attend)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    curve = []
    for _ in range(STEPS):
        half = torch.randint(0, VOCAB, (BATCH, SEQ // 2), generator=data)
        count = (half[:, -1:] + torch.arange(1, SEQ - SEQ // 2 + 1)) % VOCAB
        tokens = torch.cat([half, count], dim=1)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                 tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        curve.append(loss.item())
    return torch.tensor(curve)


@pytest.fixture(scope="module")
def sdpa_curve():
    return losses(sdpa_attention)


@pytest.mark.parametrize("kernel", [None, "tiled"], ids=["dispatched", "tiled"])
def test_loss_curve_matches_sdpa(kernel, sdpa_curve):
    want = sdpa_curve
    got = losses(portattn_attention(kernel))
    assert want[-5:].mean() < 0.75 * want[0]  # it learns something: the comparison means something
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
