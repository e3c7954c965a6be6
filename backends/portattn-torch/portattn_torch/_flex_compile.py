"""FlexAttention compiled once per process and kind of call, then reused.

``flex_attention`` is only fast compiled (in eager mode it materialises the score
matrix), and compiling costs seconds (about 5-10 s on a 2-core CPU, where inductor
runs a C++ compiler). So each kind of call gets one ``torch.compile(...,
dynamic=True)`` entry, kept for the process: new sequence lengths and batch sizes
reuse it. A kind is what changes the code generated (the mask's structure, its fixed
parameters and a mask function's code, the score changes, scale, dtype, device, head
counts and dims, lse, gradients) and what torch specialises even under
``dynamic=True`` (sizes of 1: a batch of one, a decode step's single query, a call of
one tile; the inputs' layouts).

Each entry is its own code object: dynamo keeps its compiled graphs and its
recompilation limit per code object, and one shared function would fall back to the
unfused eager path once a process had met more than 8 kinds of calls. Within our
calls the limit is :data:`RECOMPILE_LIMIT`, for what a kind does not foresee.

Python ints are specialised (a kind fixes the mask's ints; see ``_flex_mods``). On the
CPU the tensors the mask reads are static too: there a mask holding arrays as long as
the call (packed documents, dense masks, block layouts, global tokens) or a bias
compiles once per length; masks without such arrays (causal, windows, chunks, sink
tokens, padding lengths) reuse one compilation for every length.

Every compilation is counted (:func:`compilations`) and logged at INFO level on the
``portattn`` logger, naming the kind of call.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable, Iterator

__all__ = ["compilations", "compiled_flex", "entries", "compile_settings"]

logger = logging.getLogger("portattn")

#: Graphs one kind may compile before dynamo falls back to the unfused eager flex (its
#: default, 8, is shared by everything a code object meets). A kind takes torch's
#: specialisations into account, so it should need one or two.
RECOMPILE_LIMIT = 64

_entries: dict[Hashable, Callable[..., Any]] = {}
_lock = threading.Lock()
_compiled = [0]


def compilations() -> int:
    """How many graphs this process has compiled for ``torch_flex`` so far."""
    return _compiled[0]


def entries() -> int:
    """How many kinds of call have a compiled entry."""
    return len(_entries)


def compiled_flex(kind: Hashable, label: str) -> Callable[..., Any]:
    """The compiled ``flex_attention`` for calls of ``kind`` (built on first use; it
    compiles on its first call). ``label`` names the kind in the log. The entry takes
    ``(query, key, value, score_mod, block_mask, scale, enable_gqa, lse)`` with 4-D
    tensors and returns ``(out, lse or None)``; ``block_mask`` is the ``(tables,
    mask_mod, block, with_q_blocks)`` to build flex's ``BlockMask`` from. Call it within
    :func:`compile_settings`."""
    entry = _entries.get(kind)
    if entry is None:
        with _lock:
            entry = _entries.get(kind)
            if entry is None:
                entry = _entries[kind] = _new_entry(len(_entries), label)
    return entry


def _new_entry(index: int, label: str) -> Callable[..., Any]:
    import torch
    from torch.nn.attention import flex_attention as flex

    aux_request = getattr(flex, "AuxRequest", None)

    def call(query: Any, key: Any, value: Any, score_mod: Any, block_mask: Any,
             scale: float, enable_gqa: bool, lse: bool) -> tuple[Any, Any]:
        # built here: its lengths are the tensors' (symbolic), not specialised ints
        tables, mask_mod, block, with_q_blocks = block_mask
        block_mask = flex.BlockMask.from_kv_blocks(
            *tables, BLOCK_SIZE=block, mask_mod=mask_mod,
            seq_lengths=(query.shape[-2], key.shape[-2]), compute_q_blocks=with_q_blocks)
        if not lse:
            out = flex.flex_attention(query, key, value, score_mod=score_mod,
                                      block_mask=block_mask, scale=scale,
                                      enable_gqa=enable_gqa)
            return out, None
        if aux_request is not None:  # newer torch: return_lse warns there
            out, aux = flex.flex_attention(query, key, value, score_mod=score_mod,
                                           block_mask=block_mask, scale=scale,
                                           enable_gqa=enable_gqa,
                                           return_aux=aux_request(lse=True))
            return out, aux.lse
        return flex.flex_attention(query, key, value, score_mod=score_mod,
                                   block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                                   return_lse=True)

    # a code object of its own: its own compiled graphs and recompilation limit
    call.__code__ = call.__code__.replace(co_name=f"torch_flex_{index}")
    call.__name__ = call.__qualname__ = f"torch_flex_{index}"
    with _torch_deprecations_ignored():
        return torch.compile(call, dynamic=True, backend=_counting_backend(label))


@contextlib.contextmanager
def _torch_deprecations_ignored() -> Iterator[None]:
    """Inductor imports modules of torch's that use its own deprecated APIs: not the
    caller's to act on (and an error where warnings are errors)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def _counting_backend(label: str) -> Callable[..., Any]:
    import torch

    inductor = torch._dynamo.lookup_backend("inductor")
    seen: set[Any] = set()

    def backend(graph: Any, example_inputs: Any, **kwargs: Any) -> Any:
        # a compilation dynamo restarts comes back with the same id: count it once
        compile_id = torch._guards.CompileContext.current_compile_id()
        ident = None if compile_id is None else (compile_id.frame_id,
                                                 compile_id.frame_compile_id)
        if ident is None or ident not in seen:
            seen.add(ident)
            _compiled[0] += 1
            logger.info("torch_flex: compiling flex_attention for %s (compilation %d in "
                        "this process; later calls of this kind reuse it)", label,
                        _compiled[0])
        with _torch_deprecations_ignored():
            return inductor(graph, example_inputs, **kwargs)

    return backend


def compile_settings(grad: bool) -> Any:
    """The dynamo settings of a compiled call: Python floats (the scale, a softcap) and
    ints (the mask's) static, and room for :data:`RECOMPILE_LIMIT` graphs per kind. Sizes
    that happen to be equal in the first call get a symbol each (no "duck" shapes):
    else a kind first met as self-attention (``Lq == Lk``) compiles again for its first
    chunk of a prefill or cross-attention call. Not while torch.compile traces a
    caller: its own settings hold there. With ``grad``, dynamo's tracing reads ``.grad``
    of non-leaf inputs (projections of a model's activations), which warns: not the
    caller's to act on."""
    import torch
    import torch.fx.experimental._config as shapes

    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    settings = {"specialize_float": True, "specialize_int": True,
                "recompile_limit": RECOMPILE_LIMIT}
    config = torch._dynamo.config
    patch = config.patch(**{k: v for k, v in settings.items() if hasattr(config, k)})
    if hasattr(shapes, "use_duck_shape"):
        patch = _both(patch, shapes.patch(use_duck_shape=False))
    patch = _cached_lookups_ignored(patch)
    return _non_leaf_grad_ignored(patch) if grad else patch


@contextlib.contextmanager
def _both(first: Any, second: Any) -> Iterator[None]:
    with first, second:
        yield


@contextlib.contextmanager
def _cached_lookups_ignored(inner: Any) -> Iterator[None]:
    """A score function written against the array API looks its namespace up through
    array-api-compat's cached helpers, which dynamo traces through with a warning: not
    the caller's to act on."""
    with inner, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Dynamo detected a call to a "
                                "`functools.lru_cache`-wrapped function", category=UserWarning)
        yield


@contextlib.contextmanager
def _non_leaf_grad_ignored(inner: Any) -> Iterator[None]:
    with inner, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is "
                                "not a leaf Tensor", category=UserWarning)
        yield
