"""``vllm-hybrid-npu-lab hitrate`` end to end on a tiny trace: JSON schema, numbers, bad input."""

from __future__ import annotations

import json

from vllm_hybrid_npu_lab.__main__ import main


def test_hitrate_json(tmp_path, tiny_model_dir, capsys, write_trace):
    trace = write_trace(
        tmp_path / "t.jsonl",
        [(0, 1500, 3, [1, 2, 3]), (20_000, 1500, 3, [1, 2, 4]), (40_000, 1500, 3, [1, 2, 5])],
    )
    rc = main(
        ["hitrate", "--trace", str(trace), "--model", str(tiny_model_dir), "--block-size", "1024",
         "--kv-cache-gib", "0.05", "--json", "--quiet"]
    )
    assert rc == 0
    out = capsys.readouterr().out
    # vLLM was imported by other tests before the CLI could send its logs to stderr: skip them
    report = json.loads(out[out.index("\n{") + 1 :] if not out.startswith("{") else out)
    assert report["block_size"] == 1024
    # infinite bound at 1024: the 2nd and 3rd prompts hit the 1024 shared tokens
    assert report["infinite_bound"] == 2048 / 4500
    # attention bound at the kernel block size (16): also 1024 tokens each
    assert report["attention_bound"] == 2048 / 4500
    up = report["policies"]["upstream"]
    for key in ("token_hit_rate", "request_hit_rate", "prompt_tokens", "cached_prompt_tokens",
                "computed_prompt_tokens", "cached_states"):
        assert key in up
    assert up["prompt_tokens"] == 4500
    assert up["token_hit_rate"] == up["cached_prompt_tokens"] / 4500
    assert up["cached_prompt_tokens"] == 2048  # junction == last block boundary: hits at once
    # upstream is the only upstream setting replayed: it is the upstream-best row
    assert report["policies"]["upstream-best"] == {**up, "setting": "upstream"}
    from vllm_hybrid_npu_lab.policies import DEFAULT_POLICY

    assert report["default_policy"] == DEFAULT_POLICY
    assert "miss_reasons" in report
    # 3 requests over 40 s, 1500 prompt tokens each; throughput = offered / utilization 0.5
    assert report["offered_prompt_tokens_per_s"] == 4500 / 40
    assert report["tokens_per_s"] == 4500 / 40 / 0.5
    assert report["host_cache_gib"] == 0.0
    # extra prefill steps by reason: the first prompt (cold) stops at its last block boundary
    # 1024, then 476 tokens: one prompt_tail step; the others hit 1024 and need 1 step for 476.
    # Caching off (the requests 20 s apart: alone) never splits: 0, so all of it is beyond off.
    off = report["caching_off"]
    assert off["cached_prompt_tokens"] == 0 and off["extra_prefill_steps_per_prompt"] == 0
    assert up["extra_prefill_steps_by_reason"]["prompt_tail"] == 1 / 3
    assert sum(up["extra_prefill_steps_by_reason"].values()) == up["extra_prefill_steps_per_prompt"]
    assert up["extra_prefill_steps_beyond_off"] == 1 / 3
    assert main(
        ["hitrate", "--trace", str(trace), "--model", str(tiny_model_dir), "--block-size", "1024",
         "--kv-cache-gib", "0.05", "--quiet"]
    ) == 0
    table = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(table) if line.startswith("extra steps by reason"))
    cols = table[head].split()[4:]
    rows = {line[:34].strip(): dict(zip(cols, line[34:].split())) for line in table[head + 1:head + 5]}
    assert rows["upstream"]["tail"] == "0.33" and rows["upstream"][">off"] == "0.33"
    assert rows["caching off"]["extra"] == "0.00" and rows["attention bound"]["extra"] == "0.00"


def test_hitrate_default_and_host_tier(tmp_path, tiny_model_dir, capsys, write_trace):
    trace = write_trace(
        tmp_path / "t.jsonl", [(0, 1500, 3, [1, 2, 3]), (20_000, 1500, 3, [1, 2, 4])]
    )
    rc = main(
        ["hitrate", "--trace", str(trace), "--model", str(tiny_model_dir), "--block-size", "1024",
         "--kv-cache-gib", "0.05", "--host-cache-gib", "0.01", "--policy", "default", "--json",
         "--quiet", "--tokens-per-s", "1000"]
    )
    assert rc == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("\n{") + 1 :] if not out.startswith("{") else out)
    from vllm_hybrid_npu_lab.policies import DEFAULT_POLICY

    # the default is an upstream setting, so the best-of-replayed-upstream row comes with it
    assert [p for p in report["policies"] if p != "upstream-best"] == [DEFAULT_POLICY]
    assert report["host_cache_gib"] == 0.01 and report["tokens_per_s"] == 1000
    # the attention bound gets the device plus host bytes: 0.06 GiB
    assert report["attention"]["num_blocks"] > 0
    assert "host" in report["policies"][DEFAULT_POLICY]


def test_hitrate_bad_input_names_the_flag(tmp_path, tiny_model_dir, capsys, write_trace):
    trace = write_trace(tmp_path / "t.jsonl", [(0, 600, 1, [1, 2])])
    assert main(["hitrate", "--trace", str(trace), "--policy", "nope", "--quiet"]) == 2
    assert "--policy 'nope'" in capsys.readouterr().err
    assert main(["hitrate", "--trace", str(tmp_path / "none.jsonl"), "--quiet"]) == 2
    assert "--trace" in capsys.readouterr().err
    assert main(["hitrate", "--trace", str(trace), "--model", "no-such-model", "--quiet"]) == 2
    assert "--model 'no-such-model'" in capsys.readouterr().err
    assert main(["hitrate", "--trace", str(trace), "--host-cache-gib", "-1", "--quiet"]) == 2
    assert "--host-cache-gib" in capsys.readouterr().err
    assert main(["hitrate", "--trace", str(trace), "--host-link-gbps", "0", "--quiet"]) == 2
    assert "--host-link-gbps" in capsys.readouterr().err
