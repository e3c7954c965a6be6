"""Kernel classes that the registry tests load through hand-made entry points."""

from portattn.kernel import ANY, Kernel


class Good(Kernel):
    name = "good"
    namespaces = ANY
    devices = ANY
    dtypes = frozenset({"float32"})
    priority = 7


class Urgent(Good):
    name = "urgent"
    priority = 300


class Misnamed(Good):
    name = "something_else"


NOT_A_KERNEL = object()


class Unavailable(Good):
    name = "unavailable"
    priority = 500

    @classmethod
    def check_available(cls):
        return "no such device"


class RaisingAvailability(Good):
    """A plugin whose availability check itself fails."""

    name = "raising_availability"
    priority = 600

    @classmethod
    def check_available(cls):
        msg = "driver exploded"
        raise RuntimeError(msg)


class WrongShape(Good):
    """A plugin that declares more than it does: it drops the last query."""

    name = "wrong_shape"
    priority = 700

    def run(self, inputs):
        xp = inputs.xp
        shape = (*inputs.batch_shape, inputs.num_heads, inputs.q_len - 1, inputs.value_head_dim)
        return xp.zeros(shape, dtype=inputs.query.dtype), None, None


class RaisingReasons(Good):
    """A plugin whose refusal logic itself fails."""

    name = "raising_reasons"
    priority = 800

    @classmethod
    def not_supported_reasons(cls, inputs):
        msg = "bad declaration"
        raise KeyError(msg)


class RaisingRun(Good):
    """A plugin that fails while computing."""

    name = "raising_run"
    priority = 900

    def run(self, inputs):
        msg = "out of registers"
        raise RuntimeError(msg)


class Compiling(Good):
    """A plugin that warns before it compiles."""

    name = "compiling"
    priority = 800

    @classmethod
    def notes(cls, inputs):
        return [f"compiles a kernel for Lq={inputs.q_len} on first use"]


class RaisingNotes(Good):
    """A plugin whose notes fail."""

    name = "raising_notes"
    priority = 800

    @classmethod
    def notes(cls, inputs):
        msg = "no notes today"
        raise RuntimeError(msg)
