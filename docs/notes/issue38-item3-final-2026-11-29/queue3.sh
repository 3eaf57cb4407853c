#!/bin/bash
# item 2: two variants of `two` (cp kept on the device only; cp offered but put at the host LRU's
# cold end), at the same ret/ckpt modes; then the fit baselines run before the host-page classes
# existed in cf4.py, again (same command; a determinism check and their page classes)
cd "$(dirname "$0")"
while pgrep -f queue2.sh > /dev/null; do sleep 5; done
for part in fit check; do
  for m in two_devcp two_coldcp; do
    ./run.sh ${part}_${m}_pmu64_ckpt_ret0 $m upstream:pmu=64,ckpt $part
    ./run.sh ${part}_${m}_pmu64_final_ret1b $m upstream:ret=1b,pmu=64,ckpt=final $part
    ./run.sh ${part}_${m}_pmu64_final_ret2b $m upstream:ret=2b,pmu=64,ckpt=final $part
  done
done
./run.sh fit_plain_ckpt_ret0_r2 plain upstream:ckpt fit
./run.sh fit_plain_ckpt_final_ret1b_r2 plain upstream:ret=1b,ckpt=final fit
./run.sh fit_plain_ckpt_final_ret2b_r2 plain upstream:ret=2b,ckpt=final fit
./run.sh fit_pmu32_ret0_r2 plain upstream:pmu=32 fit
./run.sh fit_pmu32_ret1b_r2 plain upstream:ret=1b,pmu=32 fit
