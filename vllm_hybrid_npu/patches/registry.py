"""The patch registry: every change the plugin makes to vLLM / vllm-ascend goes through here.

Modelled on vllm-ascend's ``vllm_ascend/patch/`` tree: one module per patched upstream module
(or feature), each declaring :class:`Patch` entries; ``docs/patches.md`` is the index and a test
compares it with :func:`vllm_hybrid_npu.patches.all_patches`.

A :class:`Patch` names its upstream target (``module`` + ``qualname``), the stacks it applies to
(targets and vLLM / vllm-ascend versions), a gate (:attr:`Patch.wanted`: the user's switches), a
capability probe run on the upstream object itself (:attr:`Patch.probe`: "the installed stack
already does this" or "ours is not better here" skip the patch), the parameter names the
replacement relies on (:attr:`Patch.signature`), why it exists and when it can go.

Applying (:func:`apply_all`) never imports an upstream module: an entry whose module is not
imported yet is applied by an import hook right after that module executes (the runner modules
are imported by vLLM's worker, never by the API server). The :class:`LoadReport` says what
applied, what is pending (waiting for its module), what was skipped and why, and what failed. A
failed entry whose :attr:`Patch.behaviour_changing` is set raises :class:`PatchError` (the user
asked for a behaviour the process would silently not have); other failures are logged at
WARNING and leave upstream's object in place.

:func:`unapply_all` restores every replaced attribute (tests).
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import inspect
import logging
import sys
import threading
from typing import Any, Callable

from vllm_hybrid_npu.support import Stack, matrix_exclusion

logger = logging.getLogger("vllm_hybrid_npu")

#: Marker attribute set on replacement objects (recognises ours; never patch twice).
MARK = "__vllm_hybrid_npu__"


class PatchError(RuntimeError):
    """A behaviour-changing patch could not be applied; the message names the patch and why."""


@dataclasses.dataclass(frozen=True)
class Patch:
    """One registry entry: a single attribute of an upstream module replaced by ours.

    Attributes:
        name: stable id shown in the load line (``"copy-kernel"``).
        module: dotted name of the upstream module holding the target.
        qualname: attribute path inside ``module`` (``"batch_memcpy"``,
            ``"VllmConfig.try_verify_and_update_config"``).
        targets: targets it applies to (subset of ``("npu", "cuda", "cpu")``).
        vllm: vLLM versions it applies to (exact base versions, ``"0.30.0"``).
        vllm_ascend: vllm-ascend versions it applies to; None when it does not depend on
            vllm-ascend.
        why: what it adds or replaces, and the measurement or bug behind it.
        until: when it can go.
        make: ``make(upstream_object, stack) -> replacement``; the registry sets the attribute.
        wanted: ``wanted(stack) -> skip reason | None``, evaluated at load (user switches).
        probe: ``probe(upstream_object, stack) -> skip reason | None``, evaluated when the
            module is imported (capabilities of the installed code).
        signature: parameter names (in order, ``self`` included) the upstream callable must
            have; a mismatch fails the entry instead of patching a function we do not know.
        trigger: module whose import applies the entry (default ``module``): e.g. vllm-ascend's
            ``patch_mamba_utils`` for an attribute of vLLM's ``mamba_utils`` that it sets.
        behaviour_changing: a failure raises :class:`PatchError` instead of a warning.
    """

    name: str
    module: str
    qualname: str
    targets: tuple[str, ...]
    vllm: tuple[str, ...]
    why: str
    until: str
    make: Callable[[Any, Stack], Any]
    vllm_ascend: tuple[str, ...] | None = None
    wanted: Callable[[Stack], str | None] | None = None
    probe: Callable[[Any, Stack], str | None] | None = None
    signature: tuple[str, ...] | None = None
    trigger: str | None = None
    behaviour_changing: bool = False

    @property
    def target(self) -> str:
        """``module:qualname``."""
        return f"{self.module}:{self.qualname}"

    def stack_mismatch(self, stack: Stack) -> str | None:
        """Why this entry is not for ``stack`` (str), or None."""
        if stack.target not in self.targets:
            return f"not for target {stack.target}"
        if stack.vllm not in self.vllm:
            return f"not for vLLM {stack.vllm} (for {', '.join(self.vllm)})"
        if self.vllm_ascend is not None and stack.vllm_ascend not in self.vllm_ascend:
            return f"not for vllm-ascend {stack.vllm_ascend} (for {', '.join(self.vllm_ascend)})"
        return None


@dataclasses.dataclass
class LoadReport:
    """What :func:`apply_all` did in this process (names are :attr:`Patch.name`)."""

    stack: Stack | None = None
    unsupported: str | None = None
    applied: list[str] = dataclasses.field(default_factory=list)
    pending: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> trigger module
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> reason
    failed: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> error

    def line(self) -> str:
        """The load line's patch part: ``applied=[..] pending=[..] skipped=[..] failed=[..]``."""
        if self.unsupported:
            return f"no patches: {self.unsupported}"
        pend = ", ".join(f"{n} (at import of {m})" for n, m in self.pending.items())
        by_reason: dict[str, list[str]] = {}
        for n, r in self.skipped.items():
            by_reason.setdefault(r, []).append(n)
        skip = "; ".join(f"{', '.join(ns)}: {r}" for r, ns in by_reason.items())
        fail = "; ".join(f"{n}: {e}" for n, e in self.failed.items())
        return (
            f"applied=[{', '.join(self.applied)}] pending=[{pend}] skipped=[{skip}] "
            f"failed=[{fail}]"
        )


_lock = threading.RLock()
REPORT = LoadReport()
#: (owner, attribute, previous value or _ABSENT, patch name), in application order.
_replaced: list[tuple[Any, str, Any, str]] = []
_ABSENT = object()


def is_ours(obj: Any) -> bool:
    """Whether ``obj`` is a replacement installed by this registry."""
    target = obj.fget if isinstance(obj, property) else obj
    return bool(getattr(target, MARK, False))


def mark(obj: Any) -> Any:
    """Mark a replacement object as ours (returns it)."""
    target = obj.fget if isinstance(obj, property) else obj
    setattr(target, MARK, True)
    return obj


def _resolve(module: Any, qualname: str) -> tuple[Any, str]:
    owner = module
    parts = qualname.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    return owner, parts[-1]


def _upstream_object(owner: Any, attr: str) -> Any:
    # a class attribute as defined (a property object, not its value); else getattr
    if isinstance(owner, type) and attr in vars(owner):
        return vars(owner)[attr]
    return getattr(owner, attr)


def _check_signature(patch: Patch, obj: Any) -> None:
    if patch.signature is None:
        return
    fn = obj.fget if isinstance(obj, property) else obj
    fn = getattr(fn, "__func__", fn)
    params = tuple(inspect.signature(fn).parameters)
    if params[: len(patch.signature)] != patch.signature:
        raise TypeError(
            f"{patch.target} has parameters {params}, expected {patch.signature} first"
        )


def _fail(patch: Patch, exc: BaseException) -> None:
    msg = f"{type(exc).__name__}: {exc}"
    with _lock:
        REPORT.pending.pop(patch.name, None)
        REPORT.failed[patch.name] = msg
    if patch.behaviour_changing:
        logger.error("vllm-hybrid-npu: patch %s (%s) failed: %s", patch.name, patch.target, msg)
        raise PatchError(f"vllm-hybrid-npu patch {patch.name} ({patch.target}) failed: {msg}") from exc
    logger.warning(
        "vllm-hybrid-npu: patch %s (%s) not applied, upstream code kept: %s",
        patch.name, patch.target, msg,
    )


def _apply_one(patch: Patch, stack: Stack, late: bool) -> None:
    try:
        module = sys.modules.get(patch.module) or importlib.import_module(patch.module)
        owner, attr = _resolve(module, patch.qualname)
        upstream = _upstream_object(owner, attr)
        if any(name == patch.name for *_, name in _replaced):  # already applied here
            with _lock:
                REPORT.pending.pop(patch.name, None)
                if patch.name not in REPORT.applied:
                    REPORT.applied.append(patch.name)
            return
        _check_signature(patch, upstream)
        reason = patch.probe(upstream, stack) if patch.probe else None
        if reason:
            with _lock:
                REPORT.pending.pop(patch.name, None)
                REPORT.skipped[patch.name] = reason
            if late:
                logger.info("vllm-hybrid-npu: patch %s skipped: %s", patch.name, reason)
            return
        new = mark(patch.make(upstream, stack))
        previous = vars(owner).get(attr, _ABSENT) if isinstance(owner, type) else getattr(owner, attr)
        setattr(owner, attr, new)
    except PatchError:
        raise
    except Exception as exc:
        _fail(patch, exc)
        return
    with _lock:
        _replaced.append((owner, attr, previous, patch.name))
        REPORT.pending.pop(patch.name, None)
        REPORT.applied.append(patch.name)
    if late:
        logger.info(
            "vllm-hybrid-npu: patch %s applied (%s, at import of %s)",
            patch.name, patch.target, patch.trigger or patch.module,
        )


# --------------------------------------------------------------------------- import hooks
class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a named module executes, so no patch imports vLLM's modules
    earlier than vLLM itself does (and a platform plugin such as vllm-ascend patches first)."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callable[[], None]]] = {}

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
                cb()

        spec.loader.exec_module = exec_module
        return spec


_finder = _PostImportFinder()


def _when_imported(module_name: str, callback: Callable[[], None]) -> bool:
    """Run ``callback()`` now if ``module_name`` is imported (returns True), else right after
    its import (returns False)."""
    if module_name in sys.modules:
        callback()
        return True
    with _lock:
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        _finder.callbacks.setdefault(module_name, []).append(callback)
    return False


# --------------------------------------------------------------------------- public API
def stack_skip_reason(patch: Patch, stack: Stack) -> str | None:
    """Why :func:`apply_all` skips ``patch`` on ``stack`` for the stack alone (outside the
    stack's support-matrix row, or not for its target / versions), or None. A stack with no
    row at all is :func:`vllm_hybrid_npu.support.unsupported_reason`'s case."""
    return matrix_exclusion(stack, patch.name) or patch.stack_mismatch(stack)


def apply_all(patches: list[Patch], stack: Stack, unsupported: str | None = None) -> LoadReport:
    """Apply ``patches`` for ``stack`` (in order) and return this process's :data:`REPORT`.

    Args:
        patches: the entries (:func:`vllm_hybrid_npu.patches.all_patches`).
        stack: the installed stack (:func:`vllm_hybrid_npu.support.detect_stack`).
        unsupported: a reason from :func:`vllm_hybrid_npu.support.unsupported_reason`; when
            given nothing is applied and the report says why. Entries outside the stack's
            matrix row (:func:`vllm_hybrid_npu.support.matrix_exclusion`) are skipped.

    Raises:
        PatchError: a behaviour-changing entry failed while being applied now (entries applied
            later raise from the import of their module).
    """
    with _lock:
        REPORT.stack = stack
        REPORT.unsupported = unsupported
    if unsupported:
        return REPORT
    for patch in patches:
        reason = stack_skip_reason(patch, stack)
        if reason is None and patch.wanted is not None:
            reason = patch.wanted(stack)
        if reason:
            with _lock:
                REPORT.skipped[patch.name] = reason
            continue
        trigger = patch.trigger or patch.module
        if trigger in sys.modules:
            _apply_one(patch, stack, late=False)
            continue
        with _lock:
            REPORT.pending[patch.name] = trigger
        _when_imported(trigger, lambda p=patch: _apply_one(p, stack, late=True))
    return REPORT


def unapply_all() -> None:
    """Restore every attribute replaced by :func:`apply_all`, drop pending hooks and reset
    :data:`REPORT` (for tests)."""
    global REPORT
    with _lock:
        for owner, attr, previous, _name in reversed(_replaced):
            if previous is _ABSENT:
                try:
                    delattr(owner, attr)
                except AttributeError:
                    pass
            else:
                setattr(owner, attr, previous)
        _replaced.clear()
        _finder.callbacks.clear()
        if _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        REPORT = LoadReport()


def original(owner: Any, attr: str) -> Any:
    """Upstream's value of ``owner.attr`` before our patch (the current value if unpatched)."""
    for o, a, previous, _name in _replaced:
        if o is owner and a == attr and previous is not _ABSENT:
            return previous
    return getattr(owner, attr)
