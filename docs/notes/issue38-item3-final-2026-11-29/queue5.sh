#!/bin/bash
# robustness of the cold-tail rule under other host pressure (not the done-when's 256 GiB):
# the check part at a 192 GiB host, the rest slice at a 128 GiB host; ret=2b and 1b, ckpt=final
cd "$(dirname "$0")"
while pgrep -f queue4.sh > /dev/null; do sleep 5; done
for r in 2b 1b; do
  ./run.sh check_h192_plain_ckpt_final_ret$r plain upstream:ret=$r,ckpt=final check 16 192
  ./run.sh check_h192_two_coldcp_pmu64_final_ret$r two_coldcp upstream:ret=$r,pmu=64,ckpt=final check 16 192
  ./run.sh check_h192_two_pmu64_final_ret$r two upstream:ret=$r,pmu=64,ckpt=final check 16 192
  ./run.sh rest_h128_plain_ckpt_final_ret$r plain upstream:ret=$r,ckpt=final rest 16 128
  ./run.sh rest_h128_two_coldcp_pmu64_final_ret$r two_coldcp upstream:ret=$r,pmu=64,ckpt=final rest 16 128
done
