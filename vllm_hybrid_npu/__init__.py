"""vllm-hybrid-npu: align-mode prefix caching for hybrid (GDN/Mamba + attention) models.

Loaded by vLLM through the ``vllm.general_plugins`` entry point (see
:func:`vllm_hybrid_npu.plugin.register`); importing this package has no side effects.
"""

from importlib.metadata import PackageNotFoundError, version as _dist_version

try:
    __version__ = _dist_version("vllm-hybrid-npu")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
