"""``portattn.distributed.attention``, ``shard`` and ``unshard``: validation, and the
engine that runs a call (a plugin found by the arrays' namespace, or a
:class:`~portattn.distributed.LocalGroup`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from array_api_compat import array_namespace
from array_api_compat import device as device_of

from .._inputs import describe
from .._lib import engine_for, namespace_name
from ..masks import Mask, dense
from ._agree import agree
from ._choice import AUTO, StrategyChoice, choose, mask_heads_problem
from ._faults import check_timeout
from ._layout import LAYOUTS, Layout
from ._strategies import STRATEGIES, backward, forward
from ._together import aborting, tell_the_others, timed
from ._ulysses import heads_problem

if TYPE_CHECKING:
    from ._plan import Problem

__all__ = ["attention", "explain", "shard", "unshard"]


def _is_local(group: Any) -> bool:
    return all(hasattr(group, n) for n in ("start_shift", "finish_shift", "all_gather",
                                           "reduce_scatter", "rank", "size"))


def _rank_and_size(group: Any, namespace: str) -> tuple[Any, int, int]:
    """``(engine, rank, size)``; the engine is None for a communicator passed as
    ``group`` (no autograd: forward only)."""
    if _is_local(group):
        return None, group.rank, group.size
    engine = engine_for(namespace)
    if engine is None:
        msg = (f"no distributed engine for {namespace} arrays is installed, and "
               f"group={group!r} is not a portattn.distributed.LocalGroup (engines: "
               f"portattn-torch for torch.distributed)")
        raise TypeError(msg)
    rank, size = engine.rank_and_size(group)
    return engine, rank, size


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        msg = f"{name} must be one of {', '.join(map(repr, choices))}; got {name}={value!r}"
        raise ValueError(msg)


def _layout(kind: str | Layout, local: int, length: int | None, size: int,
            what: str) -> Layout:
    if isinstance(kind, Layout):
        if kind.size != size or (length is not None and length != kind.length):
            msg = (f"layout={kind!r} does not fit {what}_length={length} over {size} "
                   "ranks (a Layout object holds its own length and size)")
            raise ValueError(msg)
        length = kind.length
        layout = kind
        kind = kind.kind
    elif length is None:
        length = local * size
        layout = Layout(kind, length, size)
    else:
        layout = Layout(kind, length, size)
    if layout.shard_length != local:
        msg = (f"{what}.shape[-2]={local} is not the shard length of {what}_length="
               f"{length} over {size} ranks with layout={kind!r} (expected "
               f"{layout.shard_length}; portattn.distributed.shard makes the shards)")
        raise ValueError(msg)
    return layout


def _layouts(query: Any, key: Any, value: Any, size: int, layout: str | Layout,
             query_length: int | None, key_length: int | None) -> tuple[Layout, Layout]:
    """The validated layouts of the queries and the keys of a call."""
    if not isinstance(layout, Layout):
        _check_choice("layout", layout, LAYOUTS)
    for name, x in (("query", query), ("key", key), ("value", value)):
        if len(x.shape) < 3:
            msg = f"{name} must be (..., heads, length, dim); got {name}.shape={tuple(x.shape)}"
            raise ValueError(msg)
    if key.shape[-2] != value.shape[-2]:
        msg = (f"key and value shards must have the same length; got key.shape[-2]="
               f"{key.shape[-2]}, value.shape[-2]={value.shape[-2]}")
        raise ValueError(msg)
    return (_layout(layout, query.shape[-2], query_length, size, "query"),
            _layout(layout, key.shape[-2], key_length, size, "key"))


def problem(query: Any, key: Any, value: Any, *, rank: int, size: int, mask: Any = None,
            layout: str | Layout = "contiguous", query_length: int | None = None,
            key_length: int | None = None, scale: float | None = None,
            softcap: float | None = None) -> Problem:
    """The :class:`~portattn.distributed.engine.Problem` of one rank's call, validated,
    with ``mask`` bound to the whole sequence (what :func:`attention` builds before
    running a schedule).

    Args:
        query, key, value: this rank's shards, as for :func:`attention`.
        rank: this rank's index.
        size: the number of ranks.
        mask, layout, query_length, key_length, scale, softcap: as for
            :func:`attention`.

    Returns:
        The call's :class:`~portattn.distributed.engine.Problem`.

    Example:
        >>> import numpy as np
        >>> from portattn import distributed, masks
        >>> q = np.zeros((1, 2, 4, 8))
        >>> prob = distributed.problem(q, q, q, rank=1, size=2, mask=masks.causal())
        >>> [len(prob.pairs(source)) for source in range(2)]
        [1, 1]
    """
    from ._plan import Problem

    xp = array_namespace(query, key, value)
    queries, keys = _layouts(query, key, value, size, layout, query_length, key_length)
    if mask is not None and not isinstance(mask, Mask):
        mask = dense(mask)
    bound = mask
    if mask is not None:
        bound = mask.bind(xp, tuple(query.shape[:-3]), query.shape[-3], queries.length,
                          keys.length, device_of(query))
    return Problem(xp, rank, queries, keys, bound, scale, softcap, given=mask)


def attention(query: Any, key: Any, value: Any, /, *, group: Any, mask: Any = None,
              strategy: str = AUTO, layout: str | Layout = "contiguous",
              query_length: int | None = None, key_length: int | None = None,
              scale: float | None = None, softcap: float | None = None,
              return_lse: bool = False, timeout: float | None = None) -> Any:
    """Exact attention over a sequence split across the ranks of ``group``.

    Every rank passes its shard of the queries, keys and values (made by
    :func:`shard` with the same ``layout``) and receives its shard of the output, the
    same rows as :func:`portattn.attention` of the whole sequence would give. Masks
    are given in global positions, as for one call of the whole sequence; pairs of
    shards the mask hides are never computed. Each visible pair runs through
    :func:`portattn.attention`, so the best kernel for it runs, and the partial
    results merge exactly by their log-sum-exp.

    Args:
        query: this rank's shard ``(..., Hq, Sq, D)``.
        key: this rank's shard ``(..., Hkv, Sk, D)``.
        value: this rank's shard ``(..., Hkv, Sk, Dv)``.
        group: a ``torch.distributed`` process group (with portattn-torch), or a
            :class:`LocalGroup` (threads in one process; forward only).
        mask: a :mod:`portattn.masks` mask in global positions, or a boolean array
            ``(..., Lq, Lk)``.
        strategy: ``"auto"`` (the default: one of the others, chosen from the
            shapes, dtype, number of ranks and mask alike on every rank; see
            :func:`explain`), ``"ring"`` (K/V shards pass rank to rank in pieces,
            overlapped with compute; memory for 1.25 more shards), ``"all_gather"``
            (one collective; memory for the whole K/V: short sequences, few K/V
            heads) or ``"ulysses"`` (all-to-all from sequence shards to head shards
            and back: heads that divide by the ranks, a mask that does not vary by
            head).
        layout: ``"contiguous"``, ``"zigzag"`` (balances causal masks), or a
            :class:`Layout` (:meth:`Layout.balanced` for any mask), as given to
            :func:`shard`.
        query_length: the whole sequence's queries, when padding made the shards longer
            (defaults to ``Sq * size``).
        key_length: the same for keys.
        scale: multiplies ``q @ k^T``; defaults to ``1/sqrt(D)``.
        softcap: scores become ``softcap * tanh(s / softcap)``.
        return_lse: also return this rank's rows of the log-sum-exp ``(..., Hq, Sq)``
            (float32 for half precision); gradients flow through it.
        timeout: seconds any one collective of the call (the agreement, a shift of
            the ring, a gather; in the backward too) waits for the other ranks before
            it raises :class:`CollectiveError`. None (the default): the group's own,
            the ``timeout`` given to ``torch.distributed.init_process_group`` (30
            minutes on gloo, 10 on NCCL unless set) or :func:`run_local`'s. Not used
            inside ``shard_map``, where every device runs one program.

    Returns:
        ``out`` ``(..., Hq, Sq, Dv)``, or ``(out, lse)`` with ``return_lse``. Padding
        rows hold 0 and lse ``-inf``.

    Before the schedule the ranks agree: each describes its call (shard shapes and
    dtypes, ``query_length``, ``key_length``, layout, the strategy as chosen,
    ``scale``, ``softcap`` and a digest of the mask's parameters and values) in one
    small collective. Ranks that disagree all raise the same ``ValueError`` naming
    what differs and which ranks hold which value; a rank whose own inputs are
    refused raises its error and the others a ``ValueError`` naming it. A rank that
    raises during the schedule raises its own error; the others raise
    :class:`CollectiveError` when their wait for it ends: at once where the engine
    hears of it (threads; on gloo, when the failed rank's process exits), else after
    ``timeout``. After a :class:`CollectiveError` the group is out of step: destroy it.

    Raises:
        ValueError: an unknown ``strategy`` or ``layout``, shards whose lengths do
            not fit the layout, ``strategy="ulysses"`` with heads that do not
            divide by the ranks, a mask array with a head axis or a function mask;
            ranks that disagree, or another rank that could not start the call.
        TypeError: ``group`` is neither a group of an installed engine nor a
            :class:`LocalGroup`.
        CollectiveError: another rank failed, was killed or did not answer within
            ``timeout``.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> from portattn import distributed, masks
        >>> rng = np.random.default_rng(0)
        >>> q, k, v = (rng.standard_normal((1, 2, 10, 4)) for _ in range(3))
        >>> def rank_work(group):
        ...     shards = [distributed.shard(x, group, layout="zigzag") for x in (q, k, v)]
        ...     out = distributed.attention(*shards, group=group, mask=masks.causal(),
        ...                                 layout="zigzag", query_length=10, key_length=10)
        ...     return distributed.unshard(out, group, length=10, layout="zigzag")
        >>> outs = distributed.run_local(rank_work, 3)
        >>> expected = portattn.attention(q, k, v, mask=masks.causal())
        >>> bool(np.allclose(outs[0], expected)), outs[0].shape
        (True, (1, 2, 10, 4))
    """
    xp = array_namespace(query, key, value)
    engine, rank, size = _rank_and_size(group, namespace_name(xp))
    try:
        seconds = check_timeout(timeout)
        comm = timed(group, seconds) if engine is None else None
        strategy, prob = _prepared(query, key, value, rank, size, mask=mask,
                                   strategy=strategy, layout=layout,
                                   query_length=query_length, key_length=key_length,
                                   scale=scale, softcap=softcap)
    except Exception as e:
        if rank is not None:  # inside shard_map every device runs one program
            tell_the_others(e, engine, group, query, timeout)
        raise
    if engine is None:
        agree(prob, query, key, value, strategy, comm.all_gather)
        out, lse = aborting(comm, lambda: forward(comm, prob, query, key, value, strategy))
    elif rank is None:
        out, lse = engine.attention(prob, query, key, value, group, strategy)
    else:  # the engine agrees first, where its host code runs (not traced)
        out, lse = engine.attention(prob, query, key, value, group, strategy,
                                    timeout=seconds)
    out = xp.astype(out, query.dtype, copy=False)
    return (out, lse) if return_lse else out


def _prepared(query: Any, key: Any, value: Any, rank: int | None, size: int, *,
              mask: Any, strategy: str, **options: Any) -> tuple[str, Problem]:
    """The strategy as chosen and the call's :class:`Problem`: everything a rank can
    refuse on its own inputs, checked before any collective."""
    _check_choice("strategy", strategy, (AUTO, *STRATEGIES))
    # the shards alone (dtypes, heads, head dims, scale, softcap): what every pair's
    # call would refuse, refused here instead of in the middle of the schedule
    describe(query, key, value, scale=options["scale"], softcap=options["softcap"])
    if strategy == AUTO:  # engines only ever see a concrete strategy
        strategy = explain(query, key, value, size=size, mask=mask, layout=options["layout"],
                           query_length=options["query_length"],
                           key_length=options["key_length"]).strategy
    elif strategy == "ulysses":
        why = heads_problem(query, key, size) or _mask_heads_problem(mask)
        if why is not None:
            raise ValueError(why)
    prob = problem(query, key, value, rank=0 if rank is None else rank, size=size,
                   mask=mask, **options)
    return strategy, prob


def explain(query: Any, key: Any, value: Any, /, *, size: int, mask: Any = None,
            layout: str | Layout = "contiguous", query_length: int | None = None,
            key_length: int | None = None) -> StrategyChoice:
    """The strategy ``strategy="auto"`` would run for these shards, and what each
    strategy would cost; needs no process group and computes nothing.

    The choice reads only what every rank knows alike (shapes, dtype, ``size``, the
    mask's structure and the layout), so every rank of a call chooses the same. In
    order: one rank runs ``"ring"``; ``"all_gather"`` when the whole K/V of all ranks
    is at most 4 MiB; ``"ulysses"`` when it can run (heads that divide by ``size``, a
    mask that does not vary by head) and sends fewer bytes than the ring;
    ``"all_gather"`` when the whole K/V is no larger than a rank's queries and output
    (few K/V heads); else ``"ring"``.

    Args:
        query, key, value: one rank's shards, as for :func:`attention` (any objects
            with ``shape`` and ``dtype``).
        size: the number of ranks.
        mask, layout, query_length, key_length: as for :func:`attention`.

    Returns:
        A :class:`StrategyChoice`: ``choice.strategy`` the strategy chosen,
        ``choice.why`` the rule that chose it, ``choice.options`` each strategy with
        the reasons it cannot run and the bytes a rank sends and holds, and
        ``str(choice)`` a report of all of it.

    Raises:
        ValueError: ``size`` is not an int >= 1, or as :func:`attention` for shards
            that do not fit the layout.

    Example:
        >>> import numpy as np
        >>> from portattn import distributed, masks
        >>> q = np.zeros((1, 8, 4096, 64), dtype=np.float32)   # shards of 32768
        >>> choice = distributed.explain(q, q, q, size=8, mask=masks.causal())
        >>> choice.strategy
        'ulysses'
        >>> kv = np.zeros((1, 1, 4096, 64), dtype=np.float32)  # 8 query heads per K/V head
        >>> distributed.explain(q, kv, kv, size=8).strategy
        'all_gather'
        >>> choice = distributed.explain(q, q, q, size=3)   # 8 heads over 3 ranks
        >>> choice.strategy, choice.option("ulysses").reasons[0].split(";")[0]
        ('ring', "strategy='ulysses' splits the heads over the 3 ranks")
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        msg = f"size must be an int >= 1; got size={size!r}"
        raise ValueError(msg)
    queries, keys = _layouts(query, key, value, size, layout, query_length, key_length)
    if mask is not None and not isinstance(mask, Mask):
        mask = dense(mask)
    return choose(query, key, value, size=size, mask=mask, queries=queries, keys=keys)


def _mask_heads_problem(mask: Any) -> str | None:
    """A mask that varies by head, or may (a function mask reads the head index,
    which would be this rank's own on each rank): ``"ulysses"`` cannot split it."""
    why = mask_heads_problem(mask)
    return None if why is None else f"strategy='ulysses': {why}; use 'ring' or 'all_gather'"


def gradients(group: Any, prob: Problem, query: Any, key: Any, value: Any, out: Any,
              lse: Any, dout: Any, dlse: Any = None,
              strategy: str = AUTO) -> tuple[Any, Any, Any]:
    """Gradients of this rank's query, key and value shards: the portable backward of
    :func:`attention` run over a communicator (an engine's autograd calls the same).

    Args:
        group: a communicator (:class:`LocalGroup`, or an engine's).
        prob: the call's :func:`problem`.
        query, key, value: this rank's shards.
        out, lse: what :func:`attention` returned for them (``return_lse=True``).
        dout, dlse: the gradients of ``out`` and ``lse`` (``dlse`` None for zero).
        strategy: as given to :func:`attention`; ``"auto"`` is resolved the same way,
            with ``"ring"`` for ``"ulysses"`` (whose gradients come from the library's
            autograd: every strategy's backward gives the same gradients).

    Returns:
        ``(dquery, dkey, dvalue)``, each in its shard's dtype.
    """
    _check_choice("strategy", strategy, (AUTO, *STRATEGIES))
    if strategy == AUTO:
        strategy = choose(query, key, value, size=prob.size, mask=prob.given,
                          queries=prob.queries, keys=prob.keys).strategy
        if strategy == "ulysses":  # no portable backward; the ring's is as exact
            strategy = "ring"
    return aborting(group, lambda: backward(group, prob, query, key, value, out, lse, dout,
                                            dlse, strategy))


def shard(x: Any, group: Any, *, axis: int = -2, layout: str | Layout = "contiguous",
          length: int | None = None) -> Any:
    """This rank's shard of the whole array ``x`` (positions along ``axis``), padded
    with zeros to the layout's shard length.

    Args:
        x: the whole sequence (every rank passes the same).
        group: as for :func:`attention`, or a ``(rank, size)`` pair.
        axis: the sequence axis.
        layout: ``"contiguous"`` or ``"zigzag"``.
        length: positions of ``x`` to shard (defaults to ``x.shape[axis]``).

    Returns:
        ``x`` restricted to this rank's positions, ``Layout.shard_length`` long.
    """
    rank, size = _group_position(x, group)
    n = x.shape[axis] if length is None else length
    return _whole(layout, n, size).shard(x, rank, axis=axis)


def unshard(x: Any, group: Any, *, length: int, axis: int = -2,
            layout: str | Layout = "contiguous") -> Any:
    """The whole array from every rank's shard ``x`` (an all-gather; padding
    dropped): the inverse of :func:`shard`. Not differentiable.

    Args:
        x: this rank's shard.
        group: as for :func:`attention`.
        length: positions of the whole sequence.
        axis: the sequence axis.
        layout: as given to :func:`shard`.
    """
    if _is_local(group):
        shards = group.all_gather(x)
        size = group.size
    else:
        engine, _, size = _rank_and_size(group, namespace_name(array_namespace(x)))
        shards = engine.all_gather(x, group)
    return _whole(layout, length, size).unshard(shards, axis=axis)


def _whole(layout: str | Layout, length: int, size: int) -> Layout:
    if not isinstance(layout, Layout):
        return Layout(layout, length, size)
    if (layout.length, layout.size) != (length, size):
        msg = (f"layout={layout!r} is for length={layout.length} over {layout.size} "
               f"ranks; got length={length} over {size} ranks")
        raise ValueError(msg)
    return layout


def _group_position(x: Any, group: Any) -> tuple[int, int]:
    if isinstance(group, tuple) and len(group) == 2:
        return group
    _, rank, size = _rank_and_size(group, namespace_name(array_namespace(x)))
    if rank is None:
        msg = (f"the rank in group={group!r} is only known on the device; lay the whole "
               f"array out with Layout(layout, length, {size}).rank_major(x) and split "
               f"it evenly (shard_map does)")
        raise ValueError(msg)
    return rank, size
