"""What a kernel author needs: the base class every kernel derives from, and the
description of a call it receives (:class:`AttentionInputs`, whose ``mask`` speaks the
public protocol of :mod:`portattn.masks`: ``inputs.blocks(block_q, block_k)`` is its
block form, which tiles to skip and which need ``mask.tile``). Kernels around a library
call keep the rule for non-finite inputs with :mod:`portattn.nonfinite`. Probes of
what a library is doing now (:func:`values_readable`, :func:`torch_compiling`,
:func:`jax_tracer_type`) and a dtype's name in any library (:func:`dtype_name`) are
here too, so a plugin asks them as the core does.

A kernel declares what it supports as plain class data; the base class turns that
data into rejection reasons, one short fact each. ``namespaces`` and ``devices`` are
authoritative: dispatch skips a kernel that does not declare the call's library and
device without asking it anything else (and without checking its availability, which
may import its library). Plugins extend
:meth:`Kernel.not_supported_reasons` for constraints the data cannot express, and
override :meth:`Kernel.check_available` to say why they cannot run at all here.
What a kernel computes but another kernel runs better (faster, in less memory) is a
preference, :meth:`Kernel.dispatch_reasons`: dispatch passes the kernel over for it,
and a kernel named by ``kernel=`` runs all the same; :meth:`Kernel.defers_to` names
the kernels it steps aside for, unless measured faster than them.

>>> class MyKernel(Kernel):
...     name = "my_kernel"
...     namespaces = frozenset({"numpy"})
...     devices = frozenset({"cpu"})
...     dtypes = frozenset({"float32"})
...     def run(self, inputs):
...         ...
"""

from __future__ import annotations

from typing import Any, ClassVar

from ._inputs import AttentionInputs, PagedInputs, QueryTiles, describe
from ._lib import dtype_name, jax_tracer_type, torch_compiling, tuned_value, values_readable
from .masks import Band, Mask

__all__ = ["ANY", "AttentionInputs", "Band", "Kernel", "Mask", "PagedInputs", "QueryTiles",
           "describe", "dtype_name", "jax_tracer_type", "torch_compiling", "values_readable"]

ANY = "*"
"""Wildcard for ``namespaces`` and ``devices``."""


def _score_mod_reasons(cls: type[Kernel], change: Any) -> list[str]:
    if not change.additive:
        return [] if cls.score_functions else [
            f"score_mod {change!r} (a score function) not supported"]
    if not cls.score_mod:
        return ["score_mod not supported"]
    missing = set() if cls.score_mod is True else change.kinds - cls.score_mod
    return [f"score_mod kinds {sorted(missing)} not supported (supported: "
            f"{_listed(cls.score_mod)})"] if missing else []


def _listed(values: Any) -> str:
    return ", ".join(sorted(values))


class Kernel:
    """Base class of attention kernels. Defaults support nothing optional.

    A subclass declares its capabilities as class data and implements :meth:`run`;
    a plugin registers it under the entry-point group ``portattn.kernels``, with the
    entry point named like ``name``.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> from portattn.kernel import Kernel
        >>> class MyKernel(Kernel):
        ...     name = "my_kernel"
        ...     namespaces = frozenset({"numpy"})
        ...     devices = frozenset({"cpu"})
        ...     dtypes = frozenset({"float32"})
        ...     masks = frozenset({"causal"})
        ...     def run(self, inputs):
        ...         ...
        >>> q = np.zeros((1, 2, 8, 4))
        >>> inputs = portattn.explain(q, q, q, return_lse=True).inputs
        >>> MyKernel.not_supported_reasons(inputs)
        ['dtype=float64 (supported: float32)', 'return_lse not supported']
    """

    name: ClassVar[str] = ""
    """The kernel's name, the same as its entry point's (``kernel="..."`` picks it)."""
    namespaces: ClassVar[frozenset[str] | str] = frozenset()
    """Array namespaces it runs on, by name (``"numpy"``, ``"torch"``, ...), or :data:`ANY`."""
    devices: ClassVar[frozenset[str] | str] = frozenset()
    """Device kinds it runs on (``"cpu"``, ``"cuda"``, ...), or :data:`ANY`."""
    dtypes: ClassVar[frozenset[str]] = frozenset()
    """Input dtypes it takes, by name."""
    head_dim: ClassVar[tuple[int, int | None]] = (1, None)
    """``(low, high)``: the bounds of ``D`` and ``Dv``, inclusive; ``high`` None for no
    bound."""
    masks: ClassVar[frozenset[str]] = frozenset()
    """Mask kinds it takes (names from :data:`portattn.masks.KINDS`)."""
    bias: ClassVar[bool] = False
    """Takes ``bias``."""
    softcap: ClassVar[bool] = False
    """Takes ``softcap``."""
    alibi: ClassVar[bool] = False
    """Takes ``alibi_slopes`` (a linear bias by distance, computed per tile)."""
    score_mod: ClassVar[bool | frozenset[str]] = False
    """Takes ``score_mod`` changes that add entries from tables (a :mod:`portattn.scores`
    change, computed per tile), with the tables' gradients when the kernel declares
    ``grad``: True for every kind of :data:`portattn.scores.ADDITIVE_KINDS`, or the
    kinds it takes (sums of them included)."""
    score_functions: ClassVar[bool] = False
    """Takes ``score_mod`` changes that map each score (:func:`portattn.scores.function`,
    :func:`portattn.scores.softcap`), with their arrays' gradients when the kernel
    declares ``grad``."""
    sinks: ClassVar[bool] = False
    """Takes ``sinks`` (a logit per head in each row's softmax denominator), with its
    gradient when the kernel declares ``grad``."""
    gqa: ClassVar[bool] = False
    """Takes fewer key/value heads than query heads (grouped-query attention)."""
    value_head_dim: ClassVar[bool] = False
    """Supports ``value.shape[-1] != query.shape[-1]``."""
    empty: ClassVar[bool] = False
    """Handles ``Lq == 0`` or ``Lk == 0``."""
    returns_lse: ClassVar[bool] = False
    """Returns the log-sum-exp when asked (``return_lse``)."""
    returns_weights: ClassVar[bool] = False
    """Returns the softmax weights when asked (``return_weights``)."""
    dropout: ClassVar[bool] = False
    """Takes ``dropout_p > 0``."""
    dropout_seed: ClassVar[bool] = False
    """Draws dropout's mask from ``dropout_seed`` as :mod:`portattn.dropout` does (the
    same pairs as every such kernel, regenerated in the backward), and takes calls
    with a seed; without this, a kernel that declares :attr:`dropout` draws from its
    library's generator and refuses a seed."""
    grad: ClassVar[bool] = False
    """Runs calls whose inputs require gradients, and gives them."""
    deterministic: ClassVar[bool] = True
    """Declares that the same inputs give the same result on every run."""
    finite_inputs_only: ClassVar[bool] = False
    """Exact only on finite inputs (a hidden NaN may reach the output as ``0 * NaN``).
    On the CPU dispatch then checks the output of each call whose mask or bias can hide
    anything, and the inputs of those that need gradients, and runs a call that fails
    again on a kernel that follows the rule for non-finite inputs (docs/semantics.md); a forced
    kernel raises ``KernelNotUsableError`` for it. Where
    :attr:`AttentionInputs.values_readable` is False nothing is checked: a kernel that
    wants the rule there keeps it itself."""
    paged: ClassVar[bool] = False
    """Runs calls of :func:`portattn.paged_attention` (:meth:`paged_reasons`,
    :meth:`run_paged`): packed queries of many sequences against keys read in place
    from a pool of pages. The portable loop runs those it refuses."""
    priority: ClassVar[int] = 0
    """Dispatch prefers a higher priority (ties go by name), unless a measurement of
    this machine (``python -m portattn tune``) chose another kernel."""
    tunables: ClassVar[dict[str, tuple[Any, ...]]] = {}
    """Settings ``python -m portattn tune`` may choose for this machine, each with the
    values to time (JSON numbers or strings). The kernel reads the winner with
    :meth:`tuned`, and keeps its own default where there is none."""

    #: Capability names shown by ``python -m portattn info`` and read by the
    #: conformance kit.
    CAPABILITIES: ClassVar[tuple[str, ...]] = (
        "namespaces", "devices", "dtypes", "head_dim", "masks", "bias", "softcap", "alibi",
        "score_mod", "score_functions", "sinks", "gqa", "value_head_dim", "empty", "returns_lse",
        "returns_weights", "dropout", "dropout_seed", "grad", "deterministic",
        "finite_inputs_only", "priority",
    )

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        """Every declared capability (:attr:`CAPABILITIES`) by name, as plain data.

        Returns:
            A dict from capability name to the class's value.

        Example:
            >>> from portattn.kernel import Kernel
            >>> Kernel.capabilities()["head_dim"]
            (1, None)
        """
        return {c: getattr(cls, c) for c in cls.CAPABILITIES}

    @classmethod
    def tuned(cls, setting: str) -> Any:
        """The value of a setting measured fastest on this machine.

        Args:
            setting: one of :attr:`tunables`.

        Returns:
            The winning value; None without a usable tune file or a measurement of it.
        """
        return tuned_value(cls.name, setting)

    @classmethod
    def available(cls) -> str | None:
        """Whether the kernel can run here at all (cached per class).

        Returns:
            None when it can, else why not (from :meth:`check_available`).
        """
        if "_availability" not in cls.__dict__:
            cls._availability = cls.check_available()
        return cls._availability

    @classmethod
    def check_available(cls) -> str | None:
        """Override: import the library, look for a device. Called once.

        Returns:
            None when the kernel can run here, else why not, as one short reason
            (``"unavailable: cupy is not installed"``).
        """
        return None

    @classmethod
    def target_reasons(cls, inputs: AttentionInputs | PagedInputs) -> list[str]:
        """Why the call's library or device is not one this kernel declares (dispatch
        asks a kernel nothing else, not even its availability, until this is empty).

        Args:
            inputs: the call's description.

        Returns:
            One reason per mismatch (``"namespace=torch (supported: numpy)"``); empty
            when both fit.
        """
        reasons: list[str] = []
        if cls.namespaces != ANY and inputs.namespace not in cls.namespaces:
            reasons.append(f"namespace={inputs.namespace} (supported: {_listed(cls.namespaces)})")
        if cls.devices != ANY and inputs.device not in cls.devices:
            reasons.append(f"device={inputs.device} (supported: {_listed(cls.devices)})")
        return reasons

    @classmethod
    def not_supported_reasons(cls, inputs: AttentionInputs) -> list[str]:
        """Why this kernel cannot run ``inputs`` (empty when it can). Never allocates.

        The answer must follow from the description alone (library, device, dtype,
        shapes, mask structure, options), never from array values or memory layout:
        dispatch remembers it for calls that repeat that description. Plugins extend
        it (``reasons = super().not_supported_reasons(inputs)``, then append). A
        reason here means the kernel cannot compute the call exactly; one about speed
        or memory belongs in :meth:`dispatch_reasons`.

        Args:
            inputs: the call's description.

        Returns:
            One short lower-case fact per reason (``"head_dim=320 > 256"``); empty when
            the kernel can run the call.
        """
        reasons = cls.target_reasons(inputs)
        if inputs.dtype not in cls.dtypes:
            reasons.append(f"dtype={inputs.dtype} (supported: {_listed(cls.dtypes)})")
        low, high = cls.head_dim
        for what, dim in (("head_dim", inputs.head_dim), ("value head_dim", inputs.value_head_dim)):
            if dim < low:
                reasons.append(f"{what}={dim} < {low}")
            elif high is not None and dim > high:
                reasons.append(f"{what}={dim} > {high}")
        if inputs.value_head_dim != inputs.head_dim and not cls.value_head_dim:
            reasons.append(f"value head_dim={inputs.value_head_dim} != "
                           f"head_dim={inputs.head_dim} not supported")
        if not cls.empty and (inputs.q_len == 0 or inputs.kv_len == 0):
            reasons.append(f"empty sequence (Lq={inputs.q_len}, Lk={inputs.kv_len}) "
                           "not supported")
        for kind in sorted(inputs.mask_kinds - cls.masks):
            reasons.append(f"mask {kind} not supported")
        if inputs.bias is not None and not cls.bias:
            reasons.append("bias not supported")
        if inputs.softcap is not None and not cls.softcap:
            reasons.append("softcap not supported")
        if inputs.alibi_slopes is not None and not cls.alibi:
            reasons.append("alibi_slopes not supported")
        if inputs.score_mod is not None:
            reasons += _score_mod_reasons(cls, inputs.score_mod)
        if inputs.sinks is not None and not cls.sinks:
            reasons.append("sinks not supported")
        if inputs.num_heads != inputs.num_kv_heads and not cls.gqa:
            reasons.append(f"grouped-query (Hq={inputs.num_heads}, Hkv={inputs.num_kv_heads}) "
                           "not supported")
        if inputs.return_lse and not cls.returns_lse:
            reasons.append("return_lse not supported")
        if inputs.return_weights and not cls.returns_weights:
            reasons.append("return_weights not supported")
        if inputs.dropout_p and not cls.dropout:
            reasons.append(f"dropout_p={inputs.dropout_p} not supported")
        elif inputs.dropout_seed is not None and not cls.dropout_seed:
            reasons.append("dropout_seed not supported (dropout draws from the library's "
                           "generator)")
        if inputs.requires_grad and not cls.grad:
            reasons.append("gradients required but not supported")
        return reasons

    @classmethod
    def dispatch_reasons(cls, inputs: AttentionInputs) -> list[str]:
        """Why dispatch should leave a call this kernel computes exactly to another
        kernel (another runs it faster, or in less memory); empty by default.

        A preference, not a refusal: dispatch passes the kernel over for these calls
        (``explain()`` shows each reason as ``"passed over: ..."``), runs it anyway
        when every kernel that can run the call is passed over, and a kernel named by
        ``kernel=``, :func:`~portattn.use_kernel` or ``PORTATTN_KERNEL`` runs without
        being asked. What the kernel cannot compute belongs in
        :meth:`not_supported_reasons`. The same rules hold: from the description
        alone, cheap, no allocation.

        Args:
            inputs: the call's description.

        Returns:
            One short lower-case fact per reason
            (``"262144 scores < 2097152 on cpu (tiled is faster on small calls)"``).
        """
        return []

    @classmethod
    def defers_to(cls, inputs: AttentionInputs) -> tuple[str, ...]:
        """Kernels that should run a call this kernel can run, when one of them can and
        no measurement says otherwise; empty by default.

        Where :meth:`dispatch_reasons` steps aside whatever else can run the call, a
        deferral names who: dispatch passes the kernel over only for a named kernel
        that can run the call and is not itself passed over, and measurements win
        over it (``python -m portattn tune`` on this machine, then the evidence
        plugins ship). What dispatch does with it: ``explain()`` shows
        ``"passed over: defers to ..."``. The same rules hold: from the description
        alone, cheap, no allocation.

        Args:
            inputs: the call's description.

        Returns:
            Kernel names, the preferred first (``("torch_sdpa",)``).
        """
        return ()

    @classmethod
    def notes(cls, inputs: AttentionInputs) -> list[str]:
        """What a caller should know before this kernel runs ``inputs`` (it compiles,
        it copies, ...), from the description alone; :func:`portattn.explain` shows it
        for the chosen kernel. Never asked by :func:`portattn.attention`.

        Args:
            inputs: the call's description.

        Returns:
            Short sentences; empty by default.
        """
        return []

    def run(self, inputs: AttentionInputs) -> tuple[Any, Any, Any]:
        """Compute the attention the inputs describe.

        Args:
            inputs: the call's description; ``inputs.return_lse`` and
                ``inputs.return_weights`` say what to return besides ``out``.

        Returns:
            ``(out, lse, weights)``, with None for what was not asked: ``out``
            ``(..., Hq, Lq, Dv)`` in the input dtype, ``lse`` ``(..., Hq, Lq)``,
            ``weights`` ``(..., Hq, Lq, Lk)``.
        """
        raise NotImplementedError

    @classmethod
    def paged_reasons(cls, call: PagedInputs) -> list[str]:
        """Why this kernel cannot run the paged call ``call`` (empty when it can): from
        :attr:`paged` and the declared libraries, devices and dtypes. Plugins extend it
        with what their paged loop takes (mask structure, options, queries per
        sequence); like :meth:`not_supported_reasons`, it reads the description alone
        (its lengths and table are host copies).

        Args:
            call: the paged call's description.

        Returns:
            One short lower-case fact per reason.
        """
        if not cls.paged:
            return ["paged calls not supported"]
        reasons = cls.target_reasons(call)
        if call.dtype not in cls.dtypes:
            reasons.append(f"dtype={call.dtype} (supported: {_listed(cls.dtypes)})")
        return reasons

    @classmethod
    def paged_defers_to(cls, call: PagedInputs) -> tuple[str, ...]:
        """Kernels that should run the paged call ``call`` instead of this one, when one
        of them can (measured faster on such calls); empty by default. Dispatch then
        runs the first of them, in dispatch order, that can, and
        :func:`portattn.explain_paged` shows this kernel as ``"passed over: defers to
        ..."``. From the description alone, cheap.

        Args:
            call: the paged call's description.

        Returns:
            Kernel names.
        """
        return ()

    def run_paged(self, call: PagedInputs) -> tuple[Any, Any]:
        """Compute the paged call ``call``.

        Args:
            call: the paged call's description.

        Returns:
            ``(out, lse)``: ``out`` ``(T, Hq, Dv)`` in the query's dtype and ``lse``
            ``(Hq, T)``, as :func:`portattn.paged_attention` returns them.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<kernel {self.name}>"
