#!/bin/bash
# the baselines of item 1 (no counterfactual): fit and check parts
cd "$(dirname "$0")"
for part in fit check; do
  ./run.sh ${part}_plain_ckpt_ret0 plain upstream:ckpt $part
  ./run.sh ${part}_plain_ckpt_final_ret1b plain upstream:ret=1b,ckpt=final $part
  ./run.sh ${part}_plain_ckpt_final_ret2b plain upstream:ret=2b,ckpt=final $part
  ./run.sh ${part}_pmu32_ret0 plain upstream:pmu=32 $part
  ./run.sh ${part}_pmu32_ret1b plain upstream:ret=1b,pmu=32 $part
  ./run.sh ${part}_pmu32_ret2b plain upstream:ret=2b,pmu=32 $part
done
