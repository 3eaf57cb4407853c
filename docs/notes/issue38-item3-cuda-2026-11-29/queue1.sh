#!/bin/bash
# the check part (requests 1,501-3,000 of advise --limit 3000): caching off, then every row of
# questions 2 and 3 (check_plain_ckpt_final_ret2b ran first, by hand, as the anchor)
cd "$(dirname "$0")"
p=check
./run.sh ${p}_caching_off plain caching-off $p 16 0
./run.sh ${p}_two_notail_pmu64_final_ret2b two_notail upstream:ret=2b,pmu=64,ckpt=final $p
./run.sh ${p}_plain_pmu64_final_ret2b plain upstream:ret=2b,pmu=64,ckpt=final $p
./run.sh ${p}_plain_ckpt_ret0 plain upstream:ckpt $p
./run.sh ${p}_plain_ckpt_final_ret1b plain upstream:ret=1b,ckpt=final $p
./run.sh ${p}_plain_pmu64_ckpt_ret0 plain upstream:pmu=64,ckpt $p
./run.sh ${p}_plain_pmu64_final_ret1b plain upstream:ret=1b,pmu=64,ckpt=final $p
./run.sh ${p}_pmu32_ret0 plain upstream:pmu=32 $p
./run.sh ${p}_pmu32_ret1b plain upstream:ret=1b,pmu=32 $p
./run.sh ${p}_pmu32_ret2b plain upstream:ret=2b,pmu=32 $p
for m in two two_coldcp two_notail; do
  ./run.sh ${p}_${m}_pmu64_ckpt_ret0 $m upstream:pmu=64,ckpt $p
  ./run.sh ${p}_${m}_pmu64_final_ret1b $m upstream:ret=1b,pmu=64,ckpt=final $p
  [ $m = two_notail ] || ./run.sh ${p}_${m}_pmu64_final_ret2b $m upstream:ret=2b,pmu=64,ckpt=final $p
done
