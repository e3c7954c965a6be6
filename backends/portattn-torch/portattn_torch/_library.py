"""What this plugin adds to portattn for torch (entry point ``portattn.libraries:
torch``): the tiled kernel's gradients in torch autograd, the vector-Jacobian product
that differentiates score functions, dropout's seeds (torch's own generator, its
unsigned tensors) and the engine of ``portattn.distributed`` over
``torch.distributed``. Loaded only once torch is imported."""

from __future__ import annotations

from . import _distributed as distributed
from . import _seeds as seeds
from ._autograd import attach_autograd
from ._vjp import vjp

__all__ = ["attach_autograd", "distributed", "seeds", "vjp"]
