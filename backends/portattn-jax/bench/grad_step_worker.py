"""One ``jax.jit(jax.grad(loss))`` of causal attention, measured in a fresh process.

``python grad_step_worker.py IMPL LENGTH ROUNDS`` prints one JSON line: compile
seconds, each run's seconds, XLA's memory analysis of the compiled program (bytes of
temporaries, arguments, outputs) and the process's peak resident set size (max RSS,
which includes the JAX runtime itself). IMPL is ``jax`` (``jax.nn.dot_product_attention``)
or a portattn kernel name (``dispatch`` lets portattn choose).
"""

from __future__ import annotations

import json
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import portattn
from portattn import masks

HEADS, HEAD_DIM = 8, 64


def main(impl: str, n: int, rounds: int) -> dict:
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, HEADS, n, HEAD_DIM), dtype=np.float32))
               for _ in range(3))
    lengths = jnp.asarray([n - n // 16], jnp.int32)  # the last 1/16 of the keys is padding

    def loss(q, k, v, lengths):
        if impl == "jax":
            out = jax.nn.dot_product_attention(*(jnp.swapaxes(a, 1, 2) for a in (q, k, v)),
                                               is_causal=True, key_value_seq_lengths=lengths)
        else:
            mask = masks.causal() & masks.key_lengths(lengths)
            out = portattn.attention(q, k, v, mask=mask,
                                     kernel=None if impl == "dispatch" else impl)
        return jnp.sum(out * out)

    grad = jax.jit(jax.grad(loss, (0, 1, 2)))
    start = time.perf_counter()
    compiled = grad.lower(q, k, v, lengths).compile()
    compile_s = time.perf_counter() - start
    runs = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v, lengths))
        runs.append(time.perf_counter() - start)
    memory = compiled.memory_analysis()
    return {"impl": impl, "n": n, "compile_s": compile_s, "run_s": runs,
            "xla_temp_bytes": memory.temp_size_in_bytes,
            "xla_argument_bytes": memory.argument_size_in_bytes,
            "xla_output_bytes": memory.output_size_in_bytes,
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
