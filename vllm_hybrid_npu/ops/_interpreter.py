"""A Triton kernel module run again under the Triton interpreter (CPU tensors; tests, the CPU
counterparts of the CUDA kernels).

``triton.jit`` decides compiled vs interpreted when a function is decorated, from
``TRITON_INTERPRET``; so a second copy of the module is executed with the variable set, and the
compiled kernels of the first copy stay usable in the same process.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType


def interpreted_copy(name: str, path: str) -> ModuleType:
    """The module ``name`` (its source file ``path``) executed again with ``TRITON_INTERPRET=1``,
    registered as ``name + "_interpreted"``; ``TRITON_INTERPRET`` is restored afterwards. Callers
    cache the result (one copy per process)."""
    copy_name = name + "_interpreted"
    spec = importlib.util.spec_from_file_location(copy_name, path)
    mod = importlib.util.module_from_spec(spec)
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        sys.modules[copy_name] = mod
        spec.loader.exec_module(mod)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    return mod
