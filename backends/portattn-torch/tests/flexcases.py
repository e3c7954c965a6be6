"""torch_flex as the tests run it: without its dispatch preferences, so that the
conformance kit's small calls reach it, and as torch's CPU flex allows."""

from __future__ import annotations

from typing import ClassVar

from portattn_torch import TorchFlexKernel


class AnyCall(TorchFlexKernel):
    """torch_flex taking every call it can compute (no size or SDPA preference)."""

    min_scores: ClassVar[dict[str, int]] = {"cpu": 0, "cuda": 0}
    leaves_sdpa_calls = False


class AnyCallOnCPU(AnyCall):
    """The same, as declared on the CPU: torch's compiled CPU flex gives no lse and has
    no backward. Tiles of 16, so the kit's short calls span several (hidden, full and
    partial ones)."""

    returns_lse = grad = False
    block = 16


def for_device(device_kind: str) -> type[AnyCall]:
    return AnyCallOnCPU if device_kind == "cpu" else AnyCall
