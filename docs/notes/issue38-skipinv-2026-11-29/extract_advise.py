"""The no-host rows this study reuses from the lab's own `advise` replays (16 GiB, no host tier,
--target cuda, the same trace, --limit 3000, fit/check split and rate as cf5/cf6): advise's fit
part (`fit.searched`) and its audit of the check part (`audit.searched`).

    python3 extract_advise.py /tmp/h21/advise-cuda-16g-audit.json > advise_nohost_rows.json

The source is the 2026-11-29 `advise --kv-cache-gib 16 --jobs 2 --audit --json` run of another
session (/tmp/h21/run.sh, started at main 629c3db; the lab code is unchanged from there to main).
"""
import json, sys

WANT = ("upstream:ckpt", "upstream:ret=1b,ckpt=final", "upstream:ret=2b,ckpt=final",
        "upstream:pmu=64,ckpt", "upstream:ret=1b,pmu=64,ckpt=final",
        "upstream:ret=2b,pmu=64,ckpt=final")
d = json.load(open(sys.argv[1]))
out = {"source": sys.argv[1], "kv_cache_gib": d["kv_cache_gib"], "host_cache_gib": d["host_cache_gib"],
       "target": d["target"], "tokens_per_s": d["tokens_per_s"], "num_requests": d["num_requests"],
       "step_ms": d["step_ms"], "carry_outputs": d["carry_outputs"],
       "caching_off": {"fit": d["fit"]["caching_off"], "check": d["caching_off"]},
       "rows": []}
for part, rows in (("fit", d["fit"]["searched"]), ("check", d["audit"]["searched"])):
    for r in rows:
        if r["policy"] in WANT and r["host_cache_gib"] == 0.0:
            out["rows"].append({"part": part, **r})
print(json.dumps(out, indent=1))
