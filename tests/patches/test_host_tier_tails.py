"""The option ``tails`` (registry entry ``host-tier-partial-tails-off``,
vLLM 0.30): vLLM's host tier (the OffloadingConnector's scheduler side, built by vLLM's real
``Scheduler`` from ``--kv-offloading-size``) keeps partial tails by default and none with ``off``.

Tiny hybrid (3 GDN + 1 attention layer), block 256: vLLM enables partial tails where a recurrent
group's block is larger than the hash unit, so with ``--prefix-match-unit 64`` (and not at the
block's own unit, where there is no tail) ``supports_partial_tail`` is True by vLLM's rule.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from vllm_hybrid_npu.patches import vllm_kv_offload_scheduler as T  # noqa: E402
from vllm_hybrid_npu_lab.model import build_setup  # noqa: E402
from vllm_hybrid_npu_lab.presets import TINY_HYBRID, resolve_model  # noqa: E402
from vllm_hybrid_npu_lab.upstream_grid import UpstreamSetting  # noqa: E402
from vllm_hybrid_npu.envs import OPTIONS_ENV  # noqa: E402


def _installed() -> str:
    import vllm

    from vllm_hybrid_npu.support import base_version

    return base_version(vllm.__version__)


pytestmark = pytest.mark.skipif(_installed() not in T.VERSIONS,
                                reason=f"{T.ENTRY} is for vLLM {', '.join(T.VERSIONS)} "
                                f"(installed: {_installed()})")


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-hybrid-tails")
    (d / "config.json").write_text(json.dumps(TINY_HYBRID))
    return resolve_model(str(d))[1]


def _connector_config(cfg, pmu):
    """The OffloadingConnector scheduler config of vLLM's ``Scheduler`` for the tiny hybrid with
    a 64 MiB host tier and ``--prefix-match-unit pmu`` (None: the block's unit)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    setup = build_setup(cfg, kv_cache_bytes=64 << 20, host_cache_bytes=64 << 20,
                        max_model_len=4096, block_size=256, tune=UpstreamSetting(pmu=pmu).tune)
    sched = Scheduler(vllm_config=setup.vllm_config, kv_cache_config=setup.kv_cache_config,
                      structured_output_manager=StructuredOutputManager(setup.vllm_config),
                      block_size=setup.block_size)
    return sched.connector.connector_scheduler


def test_default_keeps_vllms_partial_tails(cfg, apply_entries, monkeypatch):
    monkeypatch.delenv(OPTIONS_ENV, raising=False)
    report = apply_entries(T.ENTRY)
    assert T.ENTRY not in report.applied
    assert report.skipped[T.ENTRY] == f"{OPTIONS_ENV}=tails=on (vLLM's partial tails)"
    assert _connector_config(cfg, 64).config.supports_partial_tail is True


def test_off_takes_vllms_branch_without_partial_tails(cfg, apply_entries, monkeypatch):
    monkeypatch.setenv(OPTIONS_ENV, "tails=off")
    report = apply_entries(T.ENTRY)
    if T.ENTRY in report.skipped:
        pytest.skip(f"{T.ENTRY}: {report.skipped[T.ENTRY]}")
    assert report.applied == [T.ENTRY] and not report.failed
    cs = _connector_config(cfg, 64)
    assert cs.config.supports_partial_tail is False and cs._partial_tail_block_size == 0
    at_block = _connector_config(cfg, None)  # no tails at the block's unit: unchanged
    assert at_block.config.supports_partial_tail is False


def test_off_leaves_everything_else_of_the_config(cfg, apply_entries, monkeypatch):
    """The config with ``off`` equals vLLM's own in every field but ``supports_partial_tail``."""
    monkeypatch.delenv(OPTIONS_ENV, raising=False)
    apply_entries()
    vllms = _connector_config(cfg, 64).config
    monkeypatch.setenv(OPTIONS_ENV, "tails=off")
    report = apply_entries(T.ENTRY)
    if T.ENTRY in report.skipped:
        pytest.skip(f"{T.ENTRY}: {report.skipped[T.ENTRY]}")
    ours = _connector_config(cfg, 64).config
    assert vllms.supports_partial_tail and not ours.supports_partial_tail
    assert ours._replace(supports_partial_tail=True) == vllms
