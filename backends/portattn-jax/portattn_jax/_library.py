"""What this plugin adds to portattn for JAX (entry point ``portattn.libraries:
jax``): the tiled kernel's gradients as a ``jax.custom_vjp``, the vector-Jacobian
product that differentiates score functions, dropout's seeds (typed
PRNG keys), the engine of ``portattn.distributed`` inside ``shard_map``, and, before
the first mask built while JAX is imported, masks registered as pytrees. Loaded only
once JAX is imported."""

from __future__ import annotations

from . import _distributed as distributed
from . import _seeds as seeds
from ._autograd import attach_autograd
from ._pytree import register_mask_pytrees as on_import
from ._vjp import vjp

__all__ = ["attach_autograd", "distributed", "on_import", "seeds", "vjp"]
