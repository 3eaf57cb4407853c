#!/usr/bin/env bash
# Smoke test of the CPU image, run as the last build stage of docker/Dockerfile.cpu (a build step,
# not a container: it needs no container runtime). `vllm-hybrid-npu demo` serves $MODEL on
# 127.0.0.1 with align-mode prefix caching, replays three multi-turn conversations sharing a
# long system prompt, then replays the same requests against a server with prefix caching off.
# Passes when prompt tokens were served from the prefix cache and every output token id equals
# the caching-off run. Writes the demo's JSON report to $1 (default /opt/vllm-hybrid-npu/smoke.json).
set -euo pipefail
report="${1:-/opt/vllm-hybrid-npu/smoke.json}"
mkdir -p "$(dirname "$report")"
vllm-hybrid-npu demo --model "${MODEL:?MODEL is not set}" --json > "$report"
# the servers' IPC sockets (ZeroMQ) left in /tmp are not wanted in the layer
find /tmp -type s -delete 2>/dev/null || true
python3 - "$report" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
n = len(r["requests"])
print(f"smoke: block size {r['block_size']}; {r['cached_tokens']} of {r['prompt_tokens']} prompt "
      f"tokens cached ({r['token_hit_rate']:.1%}), {r['requests_with_hit']} of {n} requests hit")
for q in r["requests"]:
    print(f"smoke:   conv {q['conversation']} turn {q['turn']}: prompt {q['prompt_tokens']} tok, "
          f"cached {q['cached_tokens']}")
print(f"smoke: outputs vs prefix caching off: {'identical' if r['outputs_match'] else 'DIFFER'} "
      f"for {n} requests; plugin: {(r['plugin_log'] or ['(no plugin line)'])[0][:160]}")
ok = r["cached_tokens"] > 0 and r["requests_with_hit"] > 0 and r["outputs_match"] is True
print("smoke: PASS" if ok else "smoke: FAIL")
sys.exit(0 if ok else 1)
PY
