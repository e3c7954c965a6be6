"""Compile the kernels ahead of time for a GPU generation, without a GPU.

Run as a script (``python triton_compile_configs.py 90 --dtypes float16``), in a process where
``TRITON_INTERPRET`` is unset: it compiles every block configuration the launcher can
pick for that generation, for each kernel (the forward and the backward's dK/dV and dQ
passes), dtype and variant, and prints one JSON line per compilation: shared memory,
registers and spilled bytes (from ptxas's report), marks of the PTX and of the SASS,
the SASS's instruction count (``sass.total``: two runs compare a change to the kernels'
code by it) and the seconds the compiler took.
The tests run it in a subprocess because the interpreter tests share their process
with ``TRITON_INTERPRET=1``, which Triton reads at import.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: Kernel variants: the plain path (the deepest software pipeline, so the most shared
#: memory); the masks the kernels compute by formulas alone, with no table (band,
#: lengths, softcap, poisoned keys: "formulas"); those with tables and bit tiles
#: ("bits"); every feature at once (a bias and its gradient too: "all"); and a score
#: change by distance with its gradient, on the formulas ("distance", T5's decoder) and
#: on every feature ("distance_all"), each with head dims that are powers of two
#: ("*_even") and not, in the configuration the launcher picks for it
#: (``_configs.EXTRAS``).
_FORMULAS = {"HAS_LOWER": True, "HAS_UPPER": True, "HAS_KEY_LENGTHS": True,
             "HAS_QUERY_LENGTHS": True, "HAS_POISON": True, "SOFTCAP": True,
             "REVERSE": True, "HAS_ALIBI": True, "HAS_SINKS": True}
_BITS = {**_FORMULAS, "HAS_BAD": True, "HAS_BITS": True, "HAS_TABLE": True}
_FEATURES = {**_BITS, "HAS_BIAS": True, "BIAS_GRAD": True}
_DISTANCE = {"HAS_DISTANCE": True, "DISTANCE_GRAD": True}
VARIANTS = {
    "plain": {},
    "formulas_even": _FORMULAS,
    "formulas": {**_FORMULAS, "EVEN_D": False},
    "bits_even": _BITS,
    "bits": {**_BITS, "EVEN_D": False},
    "all_even": _FEATURES,
    "all": {**_FEATURES, "EVEN_D": False},
    "distance_even": {**_FORMULAS, **_DISTANCE},
    "distance": {**_FORMULAS, **_DISTANCE, "EVEN_D": False},
    "distance_all_even": {**_FEATURES, **_DISTANCE},
    "distance_all": {**_FEATURES, **_DISTANCE, "EVEN_D": False},
    "ws": {},  # the tensor-descriptor kernel with warp specialization
    # dropout (pointer forward and backward only), with bit tiles and with everything
    "dropout_bits_even": {**_BITS, "DROPOUT": True},
    "dropout_all_even": {**_FEATURES, "DROPOUT": True},
    # paged attention's shorter tiles (a decode step's), every feature; its
    # "formulas_even" is the tallest tile (a prefill's), "plain" the shortest
    **{f"formulas_m{rows}": _FORMULAS for rows in (16, 32, 64)},
}
#: The extra (``_configs.EXTRAS``) each level of variants is launched with.
EXTRA_OF = {"formulas": None, "bits": "bits", "all": "bias", "distance": "distance",
            "distance_all": "distance", "dropout_bits": "dropout", "dropout_all": "dropout"}
LEVELS = ("formulas", "bits", "all", "distance", "distance_all")
DROPOUT_LEVELS = ("dropout_bits", "dropout_all")


def extra_of(variant: str) -> str | None:
    return EXTRA_OF.get(variant.removesuffix("_even"))


DTYPES = {"float16": ("fp16", 2), "bfloat16": ("bf16", 2), "float32": ("fp32", 4)}
#: Kernels: the forward's three paths (pointers, tensor descriptors on sm_90 only,
#: split-KV decode), paged attention's tiles, and the two backward passes (the Delta
#: pass is a plain elementwise reduction, compiled once per dtype and head dim as
#: "delta"; the merge of paged attention's splits, with no product, as "paged_merge").
KERNELS = ("forward", "tma", "decode", "paged", "dkdv", "dq")
_FUNCTIONS = {"forward": ("_triton_kernel", "flash_forward_kernel"),
              "tma": ("_triton_tma", "flash_forward_tma_kernel"),
              "decode": ("_triton_decode", "decode_split_kernel"),
              "paged": ("_triton_paged", "paged_tile_kernel"),
              "dkdv": ("_triton_backward", "dkdv_kernel"),
              "dq": ("_triton_dq", "dq_kernel"),
              "delta": ("_triton_backward", "delta_kernel"),
              "paged_merge": ("_triton_paged", "paged_merge_kernel")}
#: Kernels with no product (no tensor-core instructions to look for).
ELEMENTWISE = ("delta", "paged_merge")
#: Shared memory a block may use, bytes (A100 and H100/H200 opt-in maxima).
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}

_INNER_STRIDES = ("stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_dod",
                  "stride_dkd", "stride_dvd", "stride_dqd", "stride_bn")
_FLOAT_POINTERS = ("Lse", "Delta", "DLse", "PartOut", "PartLse", "Poison", "Bad", "DBias",
                   "Distance", "DDistance", "Slopes", "Sinks")
_DESCRIPTORS = {"DescQ": ("BLOCK_M", "BLOCK_D"), "DescK": ("BLOCK_N", "BLOCK_D"),
                "DescV": ("BLOCK_N", "BLOCK_DV"), "DescO": ("BLOCK_M", "BLOCK_DV")}
#: What the compiled code is searched for: PTX instructions and SASS opcodes.
PTX_MARKS = {"wgmma": "wgmma.mma_async", "mma_sync": "mma.sync", "tma": "cp.async.bulk.tensor"}
#: The SASS opcodes counted, by the name the results give them.
SASS_MARKS = {"HGMMA": ("HGMMA",), "HMMA": ("HMMA",), "UTMALDG": ("UTMALDG",),
              "local": ("LDL", "STL")}
_SASS_MARK_OF = {op: mark for mark, ops in SASS_MARKS.items() for op in ops}
_SASS_OPCODE = re.compile(r"\b(" + "|".join(_SASS_MARK_OF) + r")\b")
_SASS_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s", re.MULTILINE)


def _signature(fn, dtype: str, constants: dict) -> tuple[dict, dict]:
    """Argument types and divisibility hints as the launcher's calls produce them:
    16-byte aligned pointers, unit inner strides (specialised to 1), other strides
    multiples of 16."""
    elem = DTYPES[dtype][0]
    types = {name: f"*{elem}" for name in ("Q", "K", "V", "Out", "DO", "DQ", "DK", "DV")}
    # a float32 bias, the widest (half precision inputs sum it in float32 either way)
    types.update(dict.fromkeys((*_FLOAT_POINTERS, "Bias"), "*fp32"))
    types.update(KeyLengths="*i32", QueryLengths="*i32", Table="*i32", Bits="*u8", Word="*i32",
                 Starts="*i32", Lengths="*i32", Items="*i32", Merges="*i32")
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name in _DESCRIPTORS:
            rows, cols = (constants[n] for n in _DESCRIPTORS[name])
            signature[name] = f"tensordesc<{elem}[1,1,{rows},{cols}]>"
        elif name in types:
            signature[name] = types[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("sm_scale", "softcap", "drop_scale"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


def launcher_config(arch: int, dtype: str, dim: int, variant: str, kernel: str = "forward"):
    """The configuration the launcher picks for this kernel and variant (an uneven
    head dim is one below the padded size; a bias or bit tiles: the heavy one)."""
    from portattn_triton._configs import (
        Config,
        backward_extra,
        decode_config,
        decode_max_rows,
        delta_rows,
        merge_warps,
        paged_config,
        pick_backward_config,
        pick_config,
    )

    head_dim = dim if VARIANTS[variant].get("EVEN_D", True) else dim - 8
    capability = (arch // 10, arch % 10)
    extra = extra_of(variant)
    if kernel in ("forward", "tma"):
        return pick_config(capability, DTYPES[dtype][1], head_dim, head_dim, extra)
    if kernel in ("paged", "paged_merge"):
        config = paged_config(DTYPES[dtype][1], head_dim, head_dim,
                              _paged_rows(dtype, dim, variant))
        if kernel == "paged":
            return config
        return Config(config.block_m, dim, merge_warps(config.block_m, dim), 3)
    if kernel == "decode":  # "plain": the fewest rows; else the most packed
        rows = 4 if variant == "plain" else decode_max_rows(DTYPES[dtype][1], dim)
        return decode_config(capability, DTYPES[dtype][1], head_dim, head_dim, rows, extra)
    if kernel == "delta":
        return Config(delta_rows(dim), dim, 4, 1)
    return getattr(pick_backward_config(capability, DTYPES[dtype][1], head_dim, head_dim,
                                        backward_extra(extra)), kernel)


def _paged_rows(dtype: str, dim: int, variant: str) -> int:
    """The tile height of a paged variant: "plain" the shortest, "formulas_m<rows>"
    its own, any other the tallest (see ``VARIANTS``)."""
    from portattn_triton._configs import paged_max_rows

    if variant == "plain":
        return 16
    if variant.startswith("formulas_m"):
        return int(variant.removeprefix("formulas_m"))
    return paged_max_rows(DTYPES[dtype][1], dim)


def variants(arch: int, dtype: str, dim: int, kernel: str = "forward") -> list[str]:
    """Variants worth compiling. The forward: each level uneven, and even too where the
    head dim changes the config. The backward passes: every level even and uneven
    (their register use does not order that way), none where the launcher has no
    backward. The tensor-descriptor and decode kernels: a representative subset (every
    head dim once, the levels and warp specialization at the common head dims), to keep
    the run short. float32 above head dim 128: no bias or bit tiles, and above head
    dim 64 no score change in the backward (refused)."""
    from portattn_triton._configs import (
        BACKWARD_MAX_DIM,
        DISTANCE_BACKWARD_MAX_DIM_FLOAT32,
        HEAVY_MAX_DIM_FLOAT32,
        paged_heights,
    )

    levels = LEVELS if dtype != "float32" or dim <= HEAVY_MAX_DIM_FLOAT32 else ("formulas",)
    if kernel in ("dkdv", "dq") and dtype == "float32" and (
            dim > DISTANCE_BACKWARD_MAX_DIM_FLOAT32):  # refused: no gradients there
        levels = tuple(level for level in levels if not level.startswith("distance"))
    if kernel == "delta":  # elementwise: only the widest tiles can be a question
        return ["plain"] if dim >= 128 else []
    if kernel == "tma":  # Hopper only; uneven dims need no masks there (descriptors)
        if arch < 90:
            return []
        if dtype == "float32":  # the launcher keeps head dim 256 on the pointer kernel
            return ["plain"] if dim <= 128 else []
        if dim not in (64, 128):
            return ["plain"]
        return ["plain", *(f"{level}_even" for level in levels), *(["ws"] if dim == 128
                                                                     else [])]
    heights = paged_heights(DTYPES[dtype][1], dim)
    if kernel == "paged":  # every tile height: the shortest plain too, the tallest last
        if not heights:
            return []
        return ["plain", *(f"formulas_m{rows}" for rows in heights[:-1]), "formulas_even"]
    if kernel == "paged_merge":  # the tallest tile
        return ["formulas_even"] if heights else []
    if kernel == "decode":  # the most rows and features; the fewest rows at one size
        if dtype == "float32" and dim > 128:  # no decode for float32 at head dim 256
            return []
        return (["plain"] if dim == 128 and dtype != "float32" else []) + list(levels)
    dropout = [f"{level}_even" for level in DROPOUT_LEVELS] if len(levels) > 1 else []
    if kernel != "forward":
        if dim > BACKWARD_MAX_DIM[DTYPES[dtype][1]]:
            return []
        return ["plain", *(v for level in levels for v in (f"{level}_even", level)), *dropout]
    names = [*dropout, "plain"]
    for level in levels:
        names.append(level)
        if (launcher_config(arch, dtype, dim, level, kernel)
                != launcher_config(arch, dtype, dim, f"{level}_even", kernel)):
            names.append(f"{level}_even")
    return names


def _kernel_function(kernel: str):
    import importlib

    module, name = _FUNCTIONS[kernel]
    return getattr(importlib.import_module(f"portattn_triton.{module}"), name)


def compile_one(arch: int, dtype: str, dim: int, variant: str, config=None,
                kernel: str = "forward", **flags: object) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    fn = _kernel_function(kernel)
    if config is None:
        config = launcher_config(arch, dtype, dim, variant, kernel)
    if kernel == "delta":
        constants = {"BLOCK_M": config.block_m, "BLOCK_DV": dim, "HAS_DLSE": True}
    elif kernel == "paged_merge":
        constants = {"BLOCK_M": config.block_m, "BLOCK_DV": dim, "HAS_SINKS": True}
    else:
        constants = {
            "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_D": dim,
            "BLOCK_DV": dim, "EVEN_D": True, "HAS_LOWER": False, "HAS_UPPER": False,
            "HAS_KEY_LENGTHS": False, "HAS_QUERY_LENGTHS": False, "HAS_POISON": False,
            "HAS_BAD": False, "HAS_BITS": False, "HAS_BIAS": False, "HAS_TABLE": False,
            "BIAS_GRAD": False, "HAS_DISTANCE": False, "DISTANCE_GRAD": False, "DROPOUT": False,
            "SOFTCAP": False,
            "REVERSE": False, "HAS_ALIBI": False, "HAS_SINKS": False,
            "INPUT_PRECISION": "tf32x3" if dtype == "float32" else "tf32",
            **VARIANTS[variant],
        }
    if kernel in ("decode", "paged"):
        constants["BLOCK_M"] = config.block_m
    if kernel == "tma":
        constants.pop("EVEN_D")
        constants["WARP_SPECIALIZE"] = variant == "ws"
    constants.update(flags)
    constants = {n: c for n, c in constants.items() if n in fn.arg_names}
    constants.update((n, 1) for n in _INNER_STRIDES if n in fn.arg_names)
    signature, attrs = _signature(fn, dtype, constants)
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constants,
                                    attrs=attrs)
    target = GPUTarget("cuda", arch, 32)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    log = io.StringIO()
    result = {"arch": arch, "kernel": kernel, "dtype": dtype, "dim": dim,
              "variant": variant, "config": str(config), "shared_limit": SHARED_LIMIT[arch]}
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=target, options=options)
    except Exception as e:  # reported to the test, which fails with the message
        result["error"] = f"{type(e).__name__}: {e}"[:4000]
        return result
    report = log.getvalue()
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", report)]
    result.update(seconds=round(time.perf_counter() - start, 2),
                  shared=compiled.metadata.shared, spilled=max(spills, default=None),
                  registers=max(registers, default=None), ptxas=report[-2000:],
                  ptx={k: compiled.asm["ptx"].count(m) for k, m in PTX_MARKS.items()},
                  sass=_sass_marks(compiled))
    return result


def _sass_marks(compiled) -> dict:
    """Opcode counts in the whole SASS and its instruction count (``total``), read from
    the cubin's code sections by NVIDIA's ``nvdisasm`` (shipped in Triton's wheel, next
    to ``cuobjdump``; about a third faster than ``cuobjdump -sass``, which also lists the
    debug sections); an "error" entry when it cannot run. (Triton's own listing,
    ``asm["sass"]``, stops at the 4096th instruction: its address pattern has four hex
    digits.)"""
    from triton.tools.disasm import path_to_cuobjdump

    nvdisasm = Path(path_to_cuobjdump()).with_name("nvdisasm")
    try:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            # code sections only, without the branch analysis
            sass = subprocess.run([str(nvdisasm), "--print-code", "--no-dataflow",
                                   cubin.name], check=True, capture_output=True,
                                  text=True).stdout
    except Exception as e:  # reported to the test, which fails with the message
        return {"error": f"{type(e).__name__}: {e}"[:500]}
    marks = dict.fromkeys(SASS_MARKS, 0)
    for opcode in _SASS_OPCODE.findall(sass):
        marks[_SASS_MARK_OF[opcode]] += 1
    marks["total"] = len(_SASS_INSTRUCTION.findall(sass))
    return marks


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("archs", nargs="*", type=int, default=sorted(SHARED_LIMIT))
    parser.add_argument("--dtypes", default="float16,bfloat16,float32",
                        help="comma-separated, of float16, bfloat16, float32")
    parser.add_argument("--backward-dtypes", default=None,
                        help="dtypes for the backward passes (default: --dtypes)")
    parser.add_argument("--kernels", default=",".join(KERNELS),
                        help=f"comma-separated, of {', '.join(_FUNCTIONS)}")
    parser.add_argument("--cases", default=None,
                        help="a JSON file listing the [arch, kernel, dtype, dim, variant] "
                        "cases to compile (default: every case)")
    args = parser.parse_args(argv)
    chosen = (None if args.cases is None
              else {tuple(c) for c in json.loads(Path(args.cases).read_text())})
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="portattn-triton-aot-")
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # ptxas -v report: registers, spills
    from portattn_triton._configs import BLOCK_DIMS

    for arch in args.archs:
        for kernel in args.kernels.split(","):
            dtypes = args.dtypes if kernel == "forward" else (args.backward_dtypes
                                                              or args.dtypes)
            for dtype in dtypes.split(","):
                for dim in BLOCK_DIMS:
                    for variant in variants(arch, dtype, dim, kernel):
                        if chosen is None or (arch, kernel, dtype, dim, variant) in chosen:
                            print(json.dumps(compile_one(arch, dtype, dim, variant,
                                                         kernel=kernel)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
