"""The serving benchmark's bookkeeping (benchmarks/cuda_serving.py): which rows ``--resume``
may keep, and the targets verdict. Pure functions on drawn numbers; the harness itself runs on
vLLM's CPU backend in e2e/test_cuda_serving_smoke.py."""

from __future__ import annotations

import pytest

from benchmarks.cuda_serving import RESUME_KEYS, resumable_rows, targets

IDENT = {"host": "h", "boot_id": "b", "device": "NVIDIA H100 80GB HBM3", "gpu_uuid": "GPU-1"}


def _args(rng):
    return {k: rng.randrange(1, 9999) for k in RESUME_KEYS}


def _previous(seed, args, ident=IDENT):
    return {"seed": seed, "args": dict(args), "identity": dict(ident),
            "rows": {"off": {"cold_ttft_ms": [1.0]}, "upstream": {"error": "timeout after 600 s"},
                     "plugin": {"cold_ttft_ms": [2.0]}}}


def test_resume_keeps_finished_rows_of_the_same_run(rng):
    seed, args = rng.randrange(1 << 31), _args(rng)
    kept = resumable_rows(_previous(seed, args), seed, {**args, "rows": "x", "out": "y"}, IDENT)
    assert sorted(kept) == ["off", "plugin"]  # the failed row runs again


@pytest.mark.parametrize("change", ["seed", "arg", "machine"])
def test_resume_refuses_another_run(rng, change):
    seed, args = rng.randrange(1 << 31), _args(rng)
    prev = _previous(seed, args)
    ident = dict(IDENT)
    if change == "seed":
        seed += 1
    elif change == "arg":
        key = rng.choice(RESUME_KEYS)
        args = {**args, key: args[key] + 1}
    else:
        ident["boot_id"] = "another boot"
    with pytest.raises(ValueError, match="--resume"):
        resumable_rows(prev, seed, args, ident)


def test_targets_ratio_and_no_higher_than_upstream(rng):
    off = {"cold_ttft_ms": rng.uniform(50, 500), "itl_ms": rng.uniform(5, 50),
           "copy_us_per_step": None, "syncs_per_step": None}
    up = {"cold_ttft_ms": off["cold_ttft_ms"], "itl_ms": off["itl_ms"],
          "copy_us_per_step": rng.uniform(1, 20), "syncs_per_step": float(rng.randrange(0, 3))}
    plugin = {"cold_ttft_ms": off["cold_ttft_ms"] * 1.02, "itl_ms": off["itl_ms"] * 1.05,
              "copy_us_per_step": up["copy_us_per_step"] * 1.5, "syncs_per_step": up["syncs_per_step"]}
    got = {t["metric"]: t for t in targets({"off": off, "upstream": up, "plugin": plugin})}
    assert got["cold_ttft_ms"]["met"] is True and got["cold_ttft_ms"]["ratio"] == pytest.approx(1.02)
    assert got["itl_ms"]["met"] is False and got["itl_ms"]["ratio"] == pytest.approx(1.05)
    assert got["copy_us_per_step"]["met"] is False
    assert got["copy_us_per_step"]["excess"] == pytest.approx(0.5 * up["copy_us_per_step"])
    assert got["syncs_per_step"]["met"] is True


def test_targets_v1_row_compares_with_upstream_v1_and_missing_numbers_are_unknown():
    s = {"off": {"cold_ttft_ms": 10.0, "itl_ms": 1.0, "copy_us_per_step": None, "syncs_per_step": None},
         "upstream-v1": {"cold_ttft_ms": 10.0, "itl_ms": 1.0, "copy_us_per_step": 4.0, "syncs_per_step": 0.0},
         "plugin-v1": {"cold_ttft_ms": 10.0, "itl_ms": 1.0, "copy_us_per_step": 3.0, "syncs_per_step": None}}
    got = {t["metric"]: t for t in targets(s)}
    assert got["copy_us_per_step"]["reference"] == "upstream-v1" and got["copy_us_per_step"]["met"]
    assert got["syncs_per_step"]["met"] is None
