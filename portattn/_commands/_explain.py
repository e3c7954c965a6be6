"""``python -m portattn explain``: which kernel would run a call, and why the others
would not, from its shapes, dtype, library and options, without writing the call.

The arrays are made (zeros) in the library named, as :mod:`portattn.testing` names
libraries and devices, and handed to :func:`portattn.explain`; what is printed is what
``print(portattn.explain(...))`` prints for the same call.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..masks import Mask
    from ..testing import Backend

__all__ = ["add_arguments", "run"]

DTYPES = ("float16", "bfloat16", "float32", "float64")
MASK_HELP = """\
a mask as kind[:arguments]; repeat --mask to intersect masks (&), join kinds with | for
a union ("sliding_window:128|global_tokens:0,1"). Kinds: causal[:top_left],
sliding_window:LEFT[:RIGHT], chunks:SIZE, sink_tokens:COUNT, global_tokens:P1,P2,...,
key_lengths[:N], query_lengths[:N], prefix[:N] (N for every batch element; default:
the whole length), documents[:COUNT] (COUNT equal documents, default 2), dense (every
pair allowed, as a boolean array)"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``explain``."""
    parser.add_argument("--shape", type=_shape, required=True, metavar="B,H,L,D",
                        help="the query's shape, axes in the order of --layout (any "
                             "number of leading batch axes)")
    parser.add_argument("--kv-shape", type=_shape, metavar="B,H,L,D",
                        help="key's and value's shape (default: the query's)")
    parser.add_argument("--value-dim", type=_positive, metavar="DV",
                        help="value's head dim (default: the key's)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="(default: float32)")
    parser.add_argument("--library", default="numpy",
                        help="array library, named as portattn.testing names it: numpy, "
                             "torch, jax, dask, cupy, array_api_strict (default: numpy)")
    parser.add_argument("--device", help="cpu or cuda (default: the library's own)")
    parser.add_argument("--layout", choices=("bhld", "blhd"), default="bhld",
                        help="bhld: (..., heads, length, dim), the default; blhd: "
                             "(..., length, heads, dim)")
    parser.add_argument("--mask", action="append", default=[], metavar="KIND[:ARGS]",
                        help=MASK_HELP)
    parser.add_argument("--bias", action="store_true",
                        help="an additive float bias of shape (Lq, Lk)")
    parser.add_argument("--softcap", type=float)
    parser.add_argument("--alibi", action="store_true", help="ALiBi slopes, one per head")
    parser.add_argument("--sinks", action="store_true", help="learned sinks, one per head")
    parser.add_argument("--dropout-p", type=float, default=0.0)
    parser.add_argument("--return-lse", action="store_true")
    parser.add_argument("--return-weights", action="store_true")
    parser.add_argument("--grad", action="store_true",
                        help="the call needs gradients (torch tensors that require grad)")
    parser.add_argument("--kernel", help="force this kernel, as kernel= does")


def run(args: argparse.Namespace) -> int:
    """Print the plan; 0 when a kernel can run the call, 1 when none can, 2 when the
    options describe no call."""
    from .. import explain

    try:
        backend = _backend(args.library, args.device)
        call = _Call(backend, args)
        plan = explain(*call.arrays(), **call.options())
    except (ValueError, TypeError, ImportError) as e:
        print(f"portattn explain: error: {e}", file=sys.stderr)
        return 2
    print(plan)
    return 0 if plan.kernel is not None else 1


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(n) for n in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) < 3 or min(shape) < 0:
        msg = f"expected at least 3 sizes like 2,8,1024,64; got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return shape


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        msg = f"expected a positive integer; got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return n


def _backend(library: str, device: str | None) -> Backend:
    """The test backend of ``library`` on ``device`` (``torch`` on ``cuda`` is
    ``torch_cuda``)."""
    from ..testing import BACKEND_NAMES, get_backend

    names = [library] if device is None else [f"{library}_{device}", library]
    name = next((n for n in names if n in BACKEND_NAMES), None)
    if name is None:
        known = ", ".join(BACKEND_NAMES)
        msg = f"unknown library {library!r}" + (f" on {device}" if device else "") + (
            f"; known: {known}")
        raise ValueError(msg)
    try:
        backend = get_backend(name)
    except ImportError as e:
        msg = f"{name} is not available here: {e}"
        raise ImportError(msg) from e
    if device is not None and backend.device_kind != device:
        msg = f"{library} makes its arrays on {backend.device_kind}, not {device}"
        raise ValueError(msg)
    return backend


class _Call:
    """The arrays and keyword arguments of the call the options describe."""

    def __init__(self, backend: Backend, args: argparse.Namespace) -> None:
        if args.dtype not in backend.dtypes:
            msg = (f"{backend.name} has no {args.dtype} (it has: "
                   f"{', '.join(sorted(backend.dtypes))})")
            raise ValueError(msg)
        if args.grad and backend.namespace != "torch":
            msg = ("--grad: only torch tensors say that they need gradients; with JAX, "
                   "call portattn.explain inside the function jax.grad traces")
            raise ValueError(msg)
        self.backend, self.args, self.xp = backend, args, backend.xp
        q_shape = args.shape
        kv_shape = args.kv_shape or q_shape
        heads, length = (-3, -2) if args.layout == "bhld" else (-2, -3)
        self.batch = q_shape[:-3]
        self.heads, self.q_len, self.kv_len = q_shape[heads], q_shape[length], kv_shape[length]
        self.shapes = (q_shape, kv_shape, (*kv_shape[:-1], args.value_dim or kv_shape[-1]))

    def zeros(self, shape: tuple[int, ...], dtype: str) -> Any:
        return self.xp.zeros(shape, dtype=getattr(self.xp, dtype), device=self.backend.device)

    def integers(self, values: list[int] | Any, shape: tuple[int, ...] | None = None) -> Any:
        a = self.xp.asarray(values, dtype=self.xp.int32, device=self.backend.device)
        return a if shape is None else self.xp.broadcast_to(a, shape)

    def arrays(self) -> tuple[Any, Any, Any]:
        arrays = [self.zeros(shape, self.args.dtype) for shape in self.shapes]
        if self.args.grad:
            arrays = [a.requires_grad_() for a in arrays]
        return arrays[0], arrays[1], arrays[2]

    def options(self) -> dict[str, Any]:
        args = self.args
        options: dict[str, Any] = {
            "layout": args.layout, "softcap": args.softcap, "dropout_p": args.dropout_p,
            "return_lse": args.return_lse, "return_weights": args.return_weights,
            "kernel": args.kernel, "mask": self.mask()}
        if args.bias:
            options["bias"] = self.zeros((self.q_len, self.kv_len), args.dtype)
        if args.alibi:
            options["alibi_slopes"] = self.zeros((self.heads,), "float32") + 0.5
        if args.sinks:
            options["sinks"] = self.zeros((self.heads,), "float32")
        if args.dropout_p:
            options["dropout_seed"] = 0
        return options

    def mask(self) -> Mask | None:
        """The ``--mask`` options, intersected; each a union of its ``|`` parts."""
        combined = None
        for text in self.args.mask:
            union = None
            for spec in text.split("|"):
                part = self.mask_part(spec.strip())
                union = part if union is None else union | part
            combined = union if combined is None else combined & union
        return combined

    def mask_part(self, spec: str) -> Mask:
        from .. import masks

        kind, _, rest = spec.partition(":")
        values = [v for v in rest.split(":") if v] if rest else []
        try:
            return self._mask_kind(masks, kind, values)
        except (ValueError, IndexError) as e:
            msg = f"--mask {spec!r}: {e}"
            raise ValueError(msg) from e

    def _mask_kind(self, masks: Any, kind: str, values: list[str]) -> Mask:
        if kind == "causal":
            return masks.causal(*values[:1])
        if kind == "sliding_window":
            return masks.sliding_window(*(int(v) for v in values[:2]))
        if kind in ("chunks", "sink_tokens"):
            return getattr(masks, kind)(int(values[0]))
        if kind == "global_tokens":
            return masks.global_tokens(self.integers([int(p) for p in values[0].split(",")]))
        if kind in ("key_lengths", "query_lengths", "prefix"):
            whole = self.kv_len if kind == "key_lengths" else self.q_len
            n = int(values[0]) if values else whole
            return getattr(masks, kind)(self.integers(n, self.batch))
        if kind == "documents":
            return self._documents(masks, int(values[0]) if values else 2)
        if kind == "dense":
            return masks.dense(self.xp.ones((self.q_len, self.kv_len), dtype=self.xp.bool,
                                            device=self.backend.device))
        msg = (f"unknown or unsupported kind {kind!r}; see python -m portattn explain "
               "--help (call portattn.explain from Python for the others)")
        raise ValueError(msg)

    def _documents(self, masks: Any, count: int) -> Mask:
        def ids(length: int) -> Any:
            return self.integers([i * count // max(length, 1) for i in range(length)])

        if self.q_len == self.kv_len:
            return masks.documents(ids(self.q_len))
        return masks.documents(ids(self.q_len), ids(self.kv_len))
