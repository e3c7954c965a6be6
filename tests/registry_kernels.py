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
