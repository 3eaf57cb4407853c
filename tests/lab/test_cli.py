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


def test_hitrate_bad_input_names_the_flag(tmp_path, tiny_model_dir, capsys, write_trace):
    trace = write_trace(tmp_path / "t.jsonl", [(0, 600, 1, [1, 2])])
    assert main(["hitrate", "--trace", str(trace), "--policy", "nope", "--quiet"]) == 2
    assert "--policy 'nope'" in capsys.readouterr().err
    assert main(["hitrate", "--trace", str(tmp_path / "none.jsonl"), "--quiet"]) == 2
    assert "--trace" in capsys.readouterr().err
    assert main(["hitrate", "--trace", str(trace), "--model", "no-such-model", "--quiet"]) == 2
    assert "--model 'no-such-model'" in capsys.readouterr().err
