"""A call's mask and score changes in FlexAttention's terms.

- the block form (:meth:`AttentionInputs.blocks`) gives flex's ``BlockMask`` through
  ``BlockMask.from_kv_blocks``: its index tables, per batch element and head where the
  mask varies, moved to the device once per block form;
- the mask's ``allows`` is the ``mask_mod`` flex evaluates in partial tiles. Global
  tokens are the exception: their ``allows`` reduces over the positions, which flex
  cannot lower inside a tile, so they become two per-position flag tables here;
- ``softcap``, a ``bias``, ALiBi and the rule for non-finite inputs (where no value
  can be read) join through one ``score_mod``. The bias is read at ``[b, h, q, k]`` with index
  0 on its broadcast axes, so it is never expanded or copied.

No symbol may reach ``mask_mod`` or ``score_mod``. Inductor lowers a Python int made
dynamic there badly (torch 2.11 on CUDA: ``'ShapeAsConstantBuffer' object has no
attribute 'dtype'`` for ``sequence_window(6)``), and torch's CPU flex template (seen in
torch 2.13) names symbolic sizes in its C++ by string replacement, so a symbol there
(also the length of a captured tensor in an index or a bounds check) can come out
misspelt. So the call's lengths enter as 0-d tensors and Python ints are specialised
(``_flex_compile``; a kind of call fixes the mask's ints anyway); on the CPU the
tensors the mods read are marked static too. The ``BlockMask`` is built inside the
compiled function, from the query's and key's (symbolic) lengths: built outside, its
lengths would be specialised ints and every length would compile again.
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Any

from portattn import masks

if TYPE_CHECKING:
    from collections.abc import Callable

    from portattn.kernel import AttentionInputs
    from portattn.masks import BlockMask as PortableBlockMask

__all__ = ["block_mask_of", "score_mod_of"]

# Index tables on the device, per block form (masks without arrays keep one block form
# per structure and shape: their tables move to the device once).
_tables: weakref.WeakKeyDictionary[PortableBlockMask, dict] = weakref.WeakKeyDictionary()


def block_mask_of(inputs: AttentionInputs, block: int,
                  static: bool) -> tuple[Any, tuple[int, ...], list[Any]]:
    """What the compiled call builds flex's ``BlockMask`` from, ``(tables, mask_mod,
    block, with_q_blocks)`` (the transposed tables when gradients will flow), the shape
    of its block counts ``(B | 1, H | 1, n_q_blocks)``, and the tensors its ``mask_mod``
    reads (marked static with ``static``, the CPU)."""
    tables = _device_tables(inputs.blocks(block, block), inputs)
    mask_mod, captured = (None, []) if inputs.mask is None else _mask_mod(inputs, static)
    shape = tuple(tables[0].shape)
    return (tables, mask_mod, block, inputs.requires_grad), shape, captured


def _device_tables(form: PortableBlockMask, inputs: AttentionInputs) -> tuple[Any, ...]:
    import torch

    key = (str(inputs.device_obj), inputs.batch_shape, inputs.num_heads)
    per_form = _tables.setdefault(form, {})
    found = per_form.get(key)
    if found is None:
        t = form.tables()
        arrays = ((t.kv_num_blocks, 1), (t.kv_indices, 2), (t.full_kv_num_blocks, 1),
                  (t.full_kv_indices, 2))
        found = per_form[key] = tuple(
            torch.from_numpy(_batch_and_heads(a, trailing, inputs)).to(inputs.device_obj)
            for a, trailing in arrays)
    return found


def _batch_and_heads(table: Any, trailing: int, inputs: AttentionInputs) -> Any:
    """A table ``(*lead, ...)`` whose lead broadcasts against ``(*batch, H)`` as
    ``(B | 1, H | 1, ...)``, flex's layout (batch dims flattened)."""
    import numpy as np

    rank = len(inputs.batch_shape) + 1
    tail = table.shape[table.ndim - trailing:]
    lead = table.shape[:table.ndim - trailing]
    table = table.reshape((1,) * (rank - len(lead)) + table.shape)
    heads = table.shape[rank - 1]
    if all(n == 1 for n in table.shape[:rank - 1]):
        flat = table.reshape(1, heads, *tail)
    else:
        flat = np.broadcast_to(table, (*inputs.batch_shape, heads, *tail)).reshape(
            math.prod(inputs.batch_shape), heads, *tail)
    return np.array(flat, dtype=np.int32, order="C")  # a writable copy for torch


def _mask_mod(inputs: AttentionInputs, static: bool) -> tuple[Callable[..., Any], list[Any]]:
    import torch

    device = inputs.device_obj
    # 0-d tensors, not ints: see the module's docstring
    lengths = (torch.tensor(inputs.q_len, device=device),
               torch.tensor(inputs.kv_len, device=device))
    captured: list[Any] = list(inputs.mask.arrays)
    allows = _allows(inputs.mask, inputs, lengths, captured)
    if static:
        for t in captured:
            torch._dynamo.mark_static(t)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return allows(b, h, q_idx, kv_idx)

    return mask_mod, captured


def _allows(mask: masks.Mask, inputs: AttentionInputs, lengths: tuple[Any, Any],
            captured: list[Any]) -> Callable[..., Any]:
    """``mask``'s ``allows`` at the call's lengths, with global tokens as flag tables;
    tensors read besides the mask's arrays are added to ``captured``."""
    if isinstance(mask, (masks.Intersection, masks.Union)):
        members = [_allows(p, inputs, lengths, captured) for p in mask.members]
        union = isinstance(mask, masks.Union)

        def combined(b: Any, h: Any, q: Any, k: Any) -> Any:
            allowed = members[0](b, h, q, k)
            for member in members[1:]:
                allowed = allowed | member(b, h, q, k) if union else allowed & member(b, h, q, k)
            return allowed

        return combined
    if isinstance(mask, masks.GlobalTokens):
        return _global_tokens(mask, inputs, captured)
    if isinstance(mask, masks.Function):
        captured += [c.cell_contents for c in getattr(mask.fn, "__closure__", None) or ()
                     if _is_tensor(c)]
    xp = inputs.xp
    q_len, kv_len = lengths

    def allows(b: Any, h: Any, q: Any, k: Any) -> Any:
        return mask.allows(xp, b, h, q, k, q_len, kv_len)

    return allows


def _is_tensor(cell: Any) -> bool:
    import torch

    try:
        return isinstance(cell.cell_contents, torch.Tensor)
    except ValueError:  # an empty cell
        return False


def _global_tokens(part: masks.GlobalTokens, inputs: AttentionInputs,
                   captured: list[Any]) -> Callable[..., Any]:
    """Global tokens as ``query_flags[b | 0, q] | key_flags[b | 0, k]``."""
    offset = part.query_offset(inputs.q_len, inputs.kv_len)
    query_flags = _flags(part.positions, offset, inputs.q_len)
    key_flags = _flags(part.positions, part.origin, inputs.kv_len)
    captured += [query_flags, key_flags]
    per_batch = query_flags.shape[0] > 1

    def allows(b: Any, h: Any, q: Any, k: Any) -> Any:
        row = b if per_batch else 0
        return query_flags[row, q] | key_flags[row, k]

    return allows


def _flags(positions: Any, first: int, length: int) -> Any:
    """``(B | 1, length)`` bool: index ``i`` is at a global position (``i + first`` in
    ``positions``, ``(n,)`` or ``(*batch, n)``; negative entries unused)."""
    import torch

    positions = positions.reshape(-1, positions.shape[-1])
    index = positions - first
    used = (positions >= 0) & (index >= 0) & (index < length)
    flags = torch.zeros((positions.shape[0], length + 1), dtype=torch.bool,
                        device=positions.device)
    flags.scatter_(1, torch.where(used, index, length), True)  # unused ones: column L
    return flags[:, :length]


def score_mod_of(softcap: float | None, bias: Any, bad_keys: Any,
                 alibi: tuple[Any, Any] | None = None, function: Any = None) -> Any:
    """flex's ``score_mod`` for a ``softcap``, a ``bias`` ``(B | 1, H | 1, Lq | 1,
    Lk | 1)``, ``bad_keys`` (``(B, Hq, Lk)`` float, NaN on keys whose key or value
    was not finite and 0 elsewhere: a visible one makes its row NaN, one the mask or
    the bias hides changes nothing), ALiBi's ``(slopes, offset)`` (float32
    ``(B | 1, Hq)`` and the 0-d ``Lk - Lq``: ``-slope * |q + offset - k|``, as
    ``tiled`` adds it after the softcap) and a score function (a
    :func:`portattn.scores.function` change: flex's own kind of ``score_mod``, called
    with its arrays, after the rest as ``tiled`` calls it); None when there is nothing
    to change."""
    if (softcap is None and bias is None and bad_keys is None and alibi is None
            and function is None):
        return None
    import torch

    broadcast = () if bias is None else tuple(n == 1 for n in bias.shape)

    def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if bias is not None:
            index = tuple(0 if one else i
                          for one, i in zip(broadcast, (b, h, q_idx, kv_idx), strict=True))
            score = score + bias[index]
        if alibi is not None:
            slopes, offset = alibi
            row = 0 if slopes.shape[0] == 1 else b
            score = score - slopes[row, h] * torch.abs(q_idx + offset - kv_idx)
        if function is not None:
            score = function.fn(score, b, h, q_idx, kv_idx, *function.arrays)
        if bad_keys is not None:
            # a key the bias hides (-inf) stays hidden: the mask alone is applied after
            score = torch.where(score > -math.inf, score + bad_keys[b, h, kv_idx], score)
        return score

    return score_mod
