#!/bin/bash
# item 1: cf3's `two` rule composed with the retention entry's ckpt=final (cf4.py), and the
# exporter at --prefix-match-unit 64 as installed (plain) with the same ret/ckpt mode
cd "$(dirname "$0")"
while pgrep -f queue1.sh > /dev/null; do sleep 5; done
for part in fit check; do
  ./run.sh ${part}_two_pmu64_ckpt_ret0 two upstream:pmu=64,ckpt $part
  ./run.sh ${part}_two_pmu64_final_ret1b two upstream:ret=1b,pmu=64,ckpt=final $part
  ./run.sh ${part}_two_pmu64_final_ret2b two upstream:ret=2b,pmu=64,ckpt=final $part
done
for part in fit check; do
  ./run.sh ${part}_plain_pmu64_ckpt_ret0 plain upstream:pmu=64,ckpt $part
  ./run.sh ${part}_plain_pmu64_final_ret1b plain upstream:ret=1b,pmu=64,ckpt=final $part
  ./run.sh ${part}_plain_pmu64_final_ret2b plain upstream:ret=2b,pmu=64,ckpt=final $part
done
