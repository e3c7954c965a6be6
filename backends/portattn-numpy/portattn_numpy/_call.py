"""One call: the rule for non-finite values, then the call planned and run (``_run``).

A sliding window or causal band joined to global tokens (``band | global_tokens``,
Longformer's and BigBird's local pattern) runs in three exact parts merged by their
log-sum-exps (``Config.split_global_tokens``): the band alone, planned like any mask;
every row against the global keys its band does not hold, one ``(rows, n)`` product per
head; the global rows against every key, planned without a mask. Spread-out global
tokens reach every row of tiles of the mask's grid, so through the union's block form
a call computes and masks far more pairs than the pattern allows (5.4% of the pairs and
23M masked ones for 16 tokens and a window of 512 at L = 16384, against 3.3% allowed);
here each part costs its own pairs.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from portattn import masks
from portattn.masks import FULL

from ._changes import hiding_only, may_hide
from ._decode import decode_step
from ._run import planned
from ._threads import get_num_threads, run_parallel

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs

    from ._config import Config

__all__ = ["attend"]


def attend(inputs: AttentionInputs, config: Config, tile_bytes: int) -> tuple[Any, Any]:
    """``(out, lse)`` of the call, planned with ``config`` and score tiles of
    ``tile_bytes``."""
    decoded = decode_step(inputs, config)
    if decoded is not None:
        return decoded
    if not _hides_any_pair(inputs, config):
        # every row weighs every value: NaN or inf among them reaches exactly the
        # rows that see them, and no pass over the values (a decode step's whole
        # cost) is needed to know it; a mask that hides nothing (causal, one
        # decode step) is not applied either
        return _attend(inputs._replace(mask=None), config, tile_bytes)
    finite = np.isfinite(inputs.value)
    if finite.all():  # the usual case: one pass over the values to know it
        return _attend(inputs, config, tile_bytes)
    # A masked key has weight exactly 0, but 0 * NaN is NaN: attend the values with
    # their non-finite entries zeroed, then find the rows that attend a key that held
    # one: zero queries give every key the mask and bias allow the same weight, so
    # a column marking those keys gets weight in exactly those rows (also where the
    # real weight underflowed to 0), which are NaN.
    clean = np.where(finite, inputs.value, 0)
    out, lse = _attend(inputs._replace(value=clean), config, tile_bytes)
    marks = (~finite).any(axis=-1, keepdims=True).astype(inputs.value.dtype)
    bias = inputs.bias
    hits, _ = _attend(inputs._replace(
        query=np.zeros_like(inputs.query), value=marks, value_head_dim=1,
        return_lse=False, softcap=None,
        bias=None if bias is None else np.where(bias == -np.inf, bias, np.zeros_like(bias)),
        score_mod=hiding_only(inputs.score_mod)),
        config, tile_bytes)
    out[np.broadcast_to(hits > 0, out.shape)] = np.nan
    return out, lse


def _hides_any_pair(inputs: AttentionInputs, config: Config) -> bool:
    """Can the mask, bias or score change hide a key from a row? (Known from the block
    form alone, and the change's tables.)"""
    if inputs.bias is not None or may_hide(inputs.score_mod, inputs.q_len, inputs.kv_len):
        return True
    if inputs.mask is None:
        return False
    return bool((inputs.blocks(*config.mask_grid).states != FULL).any())


def _attend(inputs: AttentionInputs, config: Config, tile_bytes: int) -> tuple[Any, Any]:
    parts = _band_and_tokens(inputs, config)
    if parts is not None:
        return _in_three_parts(inputs, config, tile_bytes, *parts)
    return planned(inputs, config, tile_bytes)


#: Scores of one unit of the global keys' part (a block of rows of the query heads that
#: share a key head, against the global keys), at most.
_GLOBAL_SCORES = 1 << 18


def _band_and_tokens(inputs: AttentionInputs, config: Config) -> tuple[Any, Any] | None:
    """``(band part, global positions read on the host)`` of a mask ``band |
    global_tokens(positions)`` that the three parts compute; None for any other call."""
    # the global rows are a call of their own, numbered from 0: a score change, which
    # reads the rows' positions, would be read there at the wrong ones
    if not config.split_global_tokens or inputs.bias is not None or (
            inputs.score_mod is not None):
        return None
    split = masks.band_and_tokens(inputs.mask)
    if split is None or split.band is None or split.tokens is None:
        return None
    positions = split.tokens.positions_on_host()
    return None if positions is None else (split.band, np.asarray(positions, dtype=np.int64))


def _in_three_parts(inputs: AttentionInputs, config: Config, tile_bytes: int,
                    band_mask: Any, positions: Any) -> tuple[Any, Any]:
    """``(out, lse)`` of ``band | global_tokens(positions)``: the band, then the global
    keys outside each row's band merged in, then the global rows put in place."""
    out, lse = planned(inputs._replace(mask=band_mask, mask_kinds=band_mask.kinds,
                                        return_lse=True), config, tile_bytes)
    lq, lk = inputs.q_len, inputs.kv_len
    band = band_mask.band(lq, lk)
    groups = ([((), positions)] if positions.ndim == 1
              else [(b, positions[b]) for b in np.ndindex(*inputs.batch_shape)])
    group = inputs.group_size
    units = []
    for b, chosen in groups:
        keys = np.unique(chosen[chosen >= 0])
        if not keys.size:
            continue
        step = max(16, _GLOBAL_SCORES // (group * keys.size))
        lead = list(np.ndindex(*inputs.batch_shape)) if b == () else [b]
        units += [(at, g, r0, min(lq, r0 + step), keys) for at in lead
                  for g in range(inputs.num_kv_heads) for r0 in range(0, lq, step)]
    if units:
        scores = group * sum((r1 - r0) * keys.size for _, _, r0, r1, keys in units)
        threads = max(1, min(get_num_threads(), scores // config.min_scores_per_thread))
        run_parallel(lambda queue: _global_keys(inputs, band, config.on_tile, out, lse,
                                                queue), units, threads)
    offset = lk - lq  # query i sits at position i + offset
    for b, chosen in groups:
        rows = np.unique(chosen[chosen >= 0]) - offset
        rows = rows[(rows >= 0) & (rows < lq)]
        if rows.size:
            _global_rows(inputs, config, tile_bytes, b, rows, out, lse)
    return out, lse if inputs.return_lse else None


def _global_keys(inputs: AttentionInputs, band: Any, on_tile: Any, out: Any, lse: Any,
                 units: Any) -> None:
    """Every row of each of ``units`` against the global keys outside its band, merged
    into ``out`` and ``lse`` (one worker thread); ``on_tile`` (``Config.on_tile``) hears
    of each key's column of scores."""
    query, key, value = (np.asarray(a) for a in (inputs.query, inputs.key, inputs.value))
    group, scale, cap = inputs.group_size, inputs.scale, inputs.softcap
    with np.errstate(all="ignore"):
        for b, g, r0, r1, keys in units:
            heads = slice(g * group, (g + 1) * group)
            if on_tile is not None:
                for h in range(g * group, (g + 1) * group):
                    for j in keys.tolist():
                        on_tile(b, h, r0, r1, j, j + 1)
            q = query[(*b, heads, slice(r0, r1))]  # (group, rows, D)
            s = np.matmul(q, key[(*b, g)][keys].T)  # (group, rows, n)
            if cap:
                s *= scale / cap
                np.tanh(s, out=s)
                s *= cap
            else:
                s *= scale
            offsets = keys[None, :] - np.arange(r0, r1)[:, None]
            inside = np.ones(offsets.shape, bool)  # the band holds these pairs already
            if band.lower is not None:
                inside &= offsets >= band.lower
            if band.upper is not None:
                inside &= offsets <= band.upper
            np.copyto(s, -np.inf, where=inside)
            top = s.max(axis=-1)
            shift = np.where(top == -np.inf, 0, top)  # rows that see no global key
            np.subtract(s, shift[..., None], out=s)
            np.exp(s, out=s)
            sums = s.sum(axis=-1)
            part = np.matmul(s, value[(*b, g)][keys])
            rows = (*b, heads, slice(r0, r1))
            _merge(out[rows], lse[rows], part, sums, shift)


def _merge(out: Any, lse: Any, part: Any, sums: Any, shift: Any) -> None:
    """``out``, ``lse`` (attention over some keys) joined in place with attention over
    other keys given as unnormalised ``part``, row ``sums`` and the ``shift`` taken off
    its scores: the split-KV identity, exact."""
    own = np.log(sums) + shift  # -inf where the part sees no key
    total = np.logaddexp(lse, own)
    seen = total != -np.inf
    safe = np.where(seen, total, 0)
    keep = np.where(seen, np.exp(lse - safe), 0)
    # the part's weights exp(s - shift) / exp(total - shift)
    add = np.where(seen, np.exp(shift - safe), 0)
    out *= keep[..., None]
    out += part * add[..., None]
    lse[...] = total


def _global_rows(inputs: AttentionInputs, config: Config, tile_bytes: int,
                 b: tuple[int, ...], rows: Any, out: Any, lse: Any) -> None:
    """The query ``rows`` of batch element ``b`` (every one when ``b`` is ``()``) against
    every key, in place of what ``out`` and ``lse`` hold for them."""
    query, key, value = (np.asarray(a) for a in (inputs.query, inputs.key, inputs.value))
    if b:
        query, key, value = query[b][None], key[b][None], value[b][None]
    part = inputs._replace(query=query[..., rows, :], key=key, value=value,
                           batch_shape=query.shape[:-3], q_len=len(rows), mask=None,
                           mask_kinds=frozenset(), return_lse=True)
    hook = config.on_tile
    if hook is not None:  # tiles of the rows taken out, told in the call's rows
        def on_tile(at: tuple[int, ...], h: int, q0: int, q1: int, k0: int,
                    k1: int) -> None:
            for i in rows[q0:q1].tolist():
                hook(b or at, h, i, i + 1, k0, k1)

        config = dataclasses.replace(config, on_tile=on_tile)
    o, m = planned(part, config, tile_bytes)
    if b:
        o, m = o[0], m[0]
    out[b][..., rows, :] = o
    lse[b][..., rows] = m
