#!/bin/bash
# robustness: a third slice (requests 3,001-3,993 of the trace), the block's unit vs the `two`
# variants and --prefix-match-unit 32 without the exporter, ret 0 / 1b / 2b
cd "$(dirname "$0")"
for r in 0 1b 2b; do
  if [ $r = 0 ]; then ex=upstream:ckpt; p64=upstream:pmu=64,ckpt; p32=upstream:pmu=32
  else ex=upstream:ret=$r,ckpt=final; p64=upstream:ret=$r,pmu=64,ckpt=final; p32=upstream:ret=$r,pmu=32; fi
  ./run.sh rest_plain_ckpt_ret$r plain $ex rest
  ./run.sh rest_two_coldcp_pmu64_ret$r two_coldcp $p64 rest
  ./run.sh rest_two_pmu64_ret$r two $p64 rest
  ./run.sh rest_pmu32_ret$r plain $p32 rest
done
