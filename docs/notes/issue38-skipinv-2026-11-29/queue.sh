#!/bin/bash
# The replay series, one at a time (run.sh: nice 10), after the other session's advise job has
# ended ("run2 end" in /tmp/h21/times.log); no replay starts after 17:32 UTC.
here=$(cd "$(dirname "$0")" && pwd)
until grep -q "run2 end" /tmp/h21/times.log; do sleep 60; done
echo "advise ended: $(grep 'run2 end' /tmp/h21/times.log); queue start $(date -u +%FT%TZ)" >> "$here/queue.log"
H="16 256"; N="16 0"
while read -r name mode policy part kv host; do
    [ -z "$name" ] && continue
    if [ "$(date -u +%H%M)" -ge 1732 ]; then echo "stop before $name: $(date -u +%FT%TZ)" >> "$here/queue.log"; break; fi
    echo "$name start $(date -u +%FT%TZ)" >> "$here/queue.log"
    "$here/run.sh" "$name" "$mode" "$policy" "$part" "$kv" "$host"
    echo "$name end $(date -u +%FT%TZ) rc=$?" >> "$here/queue.log"
done <<LIST
fit_skipinv_host_ckpt_ret0 skipinv upstream:pmu=64,ckpt fit $H
fit_skipinv_host_final_ret1b skipinv upstream:ret=1b,pmu=64,ckpt=final fit $H
fit_skipinv_host_final_ret2b skipinv upstream:ret=2b,pmu=64,ckpt=final fit $H
check_skipinv_host_ckpt_ret0 skipinv upstream:pmu=64,ckpt check $H
check_skipinv_host_final_ret1b skipinv upstream:ret=1b,pmu=64,ckpt=final check $H
check_skipinv_host_final_ret2b skipinv upstream:ret=2b,pmu=64,ckpt=final check $H
fit_plain_nohost_pmu64_final_ret1b plain upstream:ret=1b,pmu=64,ckpt=final fit $N
fit_plain_nohost_pmu64_final_ret2b plain upstream:ret=2b,pmu=64,ckpt=final fit $N
check_plain_nohost_pmu64_final_ret1b plain upstream:ret=1b,pmu=64,ckpt=final check $N
check_plain_nohost_pmu64_final_ret2b plain upstream:ret=2b,pmu=64,ckpt=final check $N
fit_skipinv_nohost_ckpt_ret0 skipinv upstream:pmu=64,ckpt fit $N
fit_skipinv_nohost_final_ret1b skipinv upstream:ret=1b,pmu=64,ckpt=final fit $N
fit_skipinv_nohost_final_ret2b skipinv upstream:ret=2b,pmu=64,ckpt=final fit $N
check_skipinv_nohost_final_ret1b skipinv upstream:ret=1b,pmu=64,ckpt=final check $N
check_skipinv_nohost_final_ret2b skipinv upstream:ret=2b,pmu=64,ckpt=final check $N
LIST
echo "queue end $(date -u +%FT%TZ)" >> "$here/queue.log"
