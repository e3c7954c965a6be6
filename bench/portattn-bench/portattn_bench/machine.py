"""A description of the machine a benchmark ran on, for the JSON and the table header."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from typing import Any

__all__ = ["describe_machine", "summary"]

#: Distributions whose versions matter to the figures (read from metadata, not imported).
LIBRARIES = ("portattn", "portattn-bench", "numpy",
             "scipy", "torch", "triton", "jax", "jaxlib", "dask",
             "distributed", "cupy", "cupy-cuda12x", "cupy-cuda11x", "array-api-compat",
             "array-api-strict", "threadpoolctl", "matplotlib")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_total() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_memory() -> int | None:
    """Bytes the OS says a new allocation can take without swapping (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _versions(extra: dict[str, str]) -> dict[str, str]:
    found = {}
    for name in LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return {**found, **extra}


def _blas() -> list[dict[str, Any]]:
    """BLAS/OpenMP libraries loaded in this process (call after the sweep imported them)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return _numpy_blas()
    keys = ("user_api", "internal_api", "version", "num_threads", "architecture", "prefix")
    return [{k: info.get(k) for k in keys if info.get(k) is not None}
            for info in threadpool_info()]


def _numpy_blas() -> list[dict[str, Any]]:
    if "numpy" not in sys.modules:
        return []
    import numpy as np

    try:
        config = np.show_config(mode="dicts")
    except TypeError:  # numpy < 1.25
        return []
    blas = (config or {}).get("Build Dependencies", {}).get("blas", {})
    return [{"user_api": "blas", "internal_api": blas.get("name"),
             "version": blas.get("version")}] if blas else []


def _gpu(device: str) -> str | None:
    if device != "cuda":
        return None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            props = cupy.cuda.runtime.getDeviceProperties(0)
            return props["name"].decode()
        except Exception:
            return None
    return None


def describe_machine(device: str = "cpu", kernel_versions: dict[str, str] | None = None
                     ) -> dict[str, Any]:
    """JSON-ready machine facts: CPU, cores, memory, BLAS, GPU, library versions."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "memory_bytes": _memory_total(),
        "gpu": _gpu(device),
        "blas": _blas(),
        "versions": _versions(kernel_versions or {}),
    }


def summary(machine: dict[str, Any]) -> str:
    """One line for the table header."""
    parts = [machine["cpu"], f"{machine['cpus_usable'] or machine['cpu_count']} cores"]
    if machine.get("memory_bytes"):
        parts.append(f"{machine['memory_bytes'] / 2**30:.0f} GiB RAM")
    blas = [b for b in machine["blas"] if b.get("user_api") == "blas"]
    if blas:
        parts.append("BLAS " + ", ".join(_library(b) for b in blas))
    if machine.get("gpu"):
        parts.append(f"GPU {machine['gpu']}")
    parts.append(f"Python {machine['python']}")
    return "; ".join(parts)


def _library(blas: dict[str, Any]) -> str:
    """``openblas 0.3.31 (Haswell)``: the kernels too, since they set the sgemm rate
    (OpenBLAS picks them as it loads, and ``OPENBLAS_CORETYPE`` forces them)."""
    name = f"{blas.get('internal_api')} {blas.get('version') or ''}".strip()
    return f"{name} ({blas['architecture']})" if blas.get("architecture") else name
