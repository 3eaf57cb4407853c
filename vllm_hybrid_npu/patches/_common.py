"""Patch helpers shared by every target (no model runner imported here).

* :func:`install_state_copy`: points ``vllm.v1.worker.mamba_utils.preprocess_mamba`` /
  ``do_mamba_copy_block`` at ours (the runners of vLLM 0.30.0/0.32.0 and vllm-ascend 0.30.0rc2
  call both through the module attribute, so replacing the attribute routes the existing call
  sites, exactly once per step, to our code).
* :func:`block_table_override`: a context in which every ``KVCacheSpec.max_num_blocks_per_req``
  (``vllm/v1/kv_cache_interface.py``) answers with :mod:`vllm_hybrid_npu.core.block_tables`;
  the runner patches wrap ``may_reinitialize_input_batch`` in it, so the input batch's
  ``MultiGroupBlockTable`` is allocated with our widths, and nothing else is affected.
* :func:`wrap_config_checks`: runs :func:`vllm_hybrid_npu.core.config_checks.check_align_mode`
  at the start of ``VllmConfig.try_verify_and_update_config``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.abc
import logging
import sys
from typing import Any, Callable

from vllm_hybrid_npu.core import block_tables, state_copy

logger = logging.getLogger("vllm_hybrid_npu")

#: Marker attribute set on our wrappers (to patch once and to recognise our own functions).
MARK = "__vllm_hybrid_npu__"

_override: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "vllm_hybrid_npu_block_table_override", default=None
)


#: ``(owner, attribute name) -> upstream object`` replaced by our patches (first seen value).
ORIGINALS: dict[tuple[Any, str], Any] = {}


def replace_attr(owner: Any, name: str, new: Any) -> None:
    """``setattr(owner, name, new)``, remembering the first non-ours value in :data:`ORIGINALS`."""
    old = getattr(owner, name, None)
    if old is not None and not is_ours(old):
        ORIGINALS[(owner, name)] = old
    setattr(owner, name, new)


def original(owner: Any, name: str) -> Any:
    """The upstream value of ``owner.name`` before our patch (the current one if unpatched)."""
    current = getattr(owner, name)
    return ORIGINALS.get((owner, name), current) if is_ours(current) else current


def is_ours(fn: Any) -> bool:
    return bool(getattr(fn, MARK, False))


def _mark(fn: Callable) -> Callable:
    setattr(fn, MARK, True)
    return fn


# --------------------------------------------------------------------------- post-import
class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a named module is executed, so the patches never import
    vLLM's runners (or anything they pull in) earlier than vLLM itself does."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callable]] = {}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.callbacks:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        callbacks = self.callbacks.pop(fullname)
        orig_exec = spec.loader.exec_module

        def exec_module(module):
            orig_exec(module)
            for cb in callbacks:
                _run_callback(cb, module)

        spec.loader.exec_module = exec_module
        return spec


def _run_callback(cb: Callable, module: Any) -> None:
    try:
        cb(module)
    except Exception as exc:  # a patch must never break vLLM's import
        logger.warning("vllm-hybrid-npu: patch on %s failed: %r", module.__name__, exc)


_finder = _PostImportFinder()


def when_imported(module_name: str, callback: Callable[[Any], None]) -> None:
    """Call ``callback(module)`` now if ``module_name`` is imported, else right after its import."""
    module = sys.modules.get(module_name)
    if module is not None:
        _run_callback(callback, module)
        return
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    _finder.callbacks.setdefault(module_name, []).append(callback)


# --------------------------------------------------------------------------- state copy
def install_state_copy(mode: str, defer_copy: bool | None = None) -> list[str]:
    """Route ``mamba_utils.preprocess_mamba`` (mode ``all``) and ``do_mamba_copy_block``
    (modes ``all`` and ``kernel``) to :mod:`vllm_hybrid_npu.core.state_copy`.

    Args:
        mode: ``"all"`` or ``"kernel"``.
        defer_copy: sets :data:`vllm_hybrid_npu.core.state_copy.DEFER_COPY` when not None.

    Returns:
        Names of what was (re)installed; empty when ``vllm.v1.worker.mamba_utils`` lacks the
        targets (logged).
    """
    try:
        from vllm.v1.worker import mamba_utils
    except Exception as exc:  # pragma: no cover - every supported vLLM has it
        logger.warning("vllm-hybrid-npu: vllm.v1.worker.mamba_utils not importable: %s", exc)
        return []
    if defer_copy is not None:
        state_copy.DEFER_COPY = defer_copy
    names = []
    if mode == "all":
        if hasattr(mamba_utils, "preprocess_mamba"):
            replace_attr(mamba_utils, "preprocess_mamba", _mark(_preprocess_mamba))
            names.append("mamba_utils.preprocess_mamba")
        else:
            logger.warning("vllm-hybrid-npu: mamba_utils.preprocess_mamba absent; not routed")
    if hasattr(mamba_utils, "do_mamba_copy_block"):
        replace_attr(mamba_utils, "do_mamba_copy_block", _mark(_do_mamba_copy_block))
        names.append("mamba_utils.do_mamba_copy_block")
    else:
        logger.warning("vllm-hybrid-npu: mamba_utils.do_mamba_copy_block absent; not routed")
    return names


def _preprocess_mamba(*args, **kwargs):
    return state_copy.preprocess_mamba(*args, **kwargs)


def _do_mamba_copy_block(copy_bufs):
    state_copy.do_mamba_copy_block(copy_bufs)


_preprocess_mamba.__doc__ = state_copy.preprocess_mamba.__doc__
_do_mamba_copy_block.__doc__ = state_copy.do_mamba_copy_block.__doc__


# --------------------------------------------------------------------------- block tables
def _spec_classes_defining(method: str) -> list[type]:
    from vllm.v1 import kv_cache_interface as kci

    out = []
    for obj in vars(kci).values():
        if isinstance(obj, type) and method in vars(obj):
            out.append(obj)
    return out


def _plain_attention(spec: Any) -> bool:
    """An attention spec whose table width is the generic per-token rule (not one that
    overrides it with a fixed size, e.g. vLLM's ``CircularBufferSpec`` which needs 1)."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    for cls in type(spec).__mro__:
        if cls is AttentionSpec:
            return True
        if "max_num_blocks_per_req" in vars(cls):
            return False
    return False


def _make_spec_method(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def max_num_blocks_per_req(self, vllm_config, max_len):
        hook = _override.get()
        if hook is None:
            return orig(self, vllm_config, max_len)
        return hook(self, orig, vllm_config, max_len)

    return _mark(max_num_blocks_per_req)


def patch_spec_methods() -> list[str]:
    """Make every ``max_num_blocks_per_req`` defined in ``vllm.v1.kv_cache_interface``
    consult :func:`block_table_override` (a no-op outside it). Idempotent.

    Returns:
        ``["<Class>.max_num_blocks_per_req", ...]`` newly patched.
    """
    names = []
    for cls in _spec_classes_defining("max_num_blocks_per_req"):
        orig = vars(cls)["max_num_blocks_per_req"]
        if is_ours(orig):
            continue
        replace_attr(cls, "max_num_blocks_per_req", _make_spec_method(orig))
        names.append(f"{cls.__name__}.max_num_blocks_per_req")
    return names


@contextlib.contextmanager
def block_table_override(vllm_config: Any):
    """Within this context, ``spec.max_num_blocks_per_req(vllm_config, max_len)`` returns
    :func:`vllm_hybrid_npu.core.block_tables.spec_max_num_blocks` (floored at upstream's
    answer) for Mamba specs and plain attention specs; other specs keep upstream's answer."""
    enable_pc = bool(getattr(vllm_config.cache_config, "enable_prefix_caching", False))
    cp = block_tables.cp_world_size_of(vllm_config)

    def hook(spec, orig, vc, max_len):
        floor = orig(spec, vc, max_len)
        from vllm.v1.kv_cache_interface import MambaSpec

        if not (isinstance(spec, MambaSpec) or _plain_attention(spec)):
            return floor
        return block_tables.spec_max_num_blocks(
            spec,
            max_len=max_len,
            enable_prefix_caching=enable_pc,
            cp_world_size=cp,
            floor=floor,
        )

    token = _override.set(hook)
    try:
        yield
    finally:
        _override.reset(token)


def wrap_may_reinitialize_input_batch(cls: type) -> str | None:
    """Wrap ``cls.may_reinitialize_input_batch`` (defined on ``cls`` itself) in
    :func:`block_table_override`. Idempotent; returns the patch name or None when absent."""
    orig = vars(cls).get("may_reinitialize_input_batch")
    if orig is None:
        logger.warning(
            "vllm-hybrid-npu: %s.may_reinitialize_input_batch absent; block tables not sized",
            cls.__name__,
        )
        return None
    if is_ours(orig):
        return f"{cls.__name__}.may_reinitialize_input_batch"

    @functools.wraps(orig)
    def may_reinitialize_input_batch(self, *args, **kwargs):
        with block_table_override(self.vllm_config):
            return orig(self, *args, **kwargs)

    replace_attr(cls, "may_reinitialize_input_batch", _mark(may_reinitialize_input_batch))
    return f"{cls.__name__}.may_reinitialize_input_batch"


# --------------------------------------------------------------------------- config checks
def wrap_config_checks(target: str | None = None) -> str | None:
    """Run our align-mode checks first in ``VllmConfig.try_verify_and_update_config``
    (vLLM 0.30.0 / 0.32.0 ``vllm/config/vllm.py``), once per config; with ``target``, then
    :func:`vllm_hybrid_npu.patches.gdn_all_mode.maybe_switch_to_all` (``'all'`` mode for GDN
    models under ``VLLM_HYBRID_NPU_CHECKPOINTS=gdn``)."""
    try:
        from vllm.config import VllmConfig
    except Exception as exc:  # pragma: no cover
        logger.warning("vllm-hybrid-npu: vllm.config.VllmConfig not importable: %s", exc)
        return None
    orig = vars(VllmConfig).get("try_verify_and_update_config")
    if orig is None:
        logger.warning("vllm-hybrid-npu: VllmConfig.try_verify_and_update_config absent")
        return None
    name = "VllmConfig.try_verify_and_update_config"
    if is_ours(orig):
        return name
    from vllm_hybrid_npu.core.config_checks import check_align_mode

    @functools.wraps(orig)
    def try_verify_and_update_config(self, *args, **kwargs):
        model_config = getattr(self, "model_config", None)
        if model_config is not None and not getattr(model_config, "config_updated", False):
            check_align_mode(self)
            # the target is resolved per call: a wrapper installed once (idempotent) serves
            # every later apply_patches call in the process
            from vllm_hybrid_npu.patches.gdn_all_mode import maybe_switch_to_all
            from vllm_hybrid_npu.target import detect_target

            maybe_switch_to_all(self, target or detect_target())
        return orig(self, *args, **kwargs)

    replace_attr(VllmConfig, "try_verify_and_update_config", _mark(try_verify_and_update_config))
    return name
