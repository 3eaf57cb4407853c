#!/bin/bash
# The series: ret 1b/2b (ckpt=final) on fit and check, then ret 0 (ckpt); one replay at a time,
# none started at or after 17:30 UTC. Logs to queue.log.
here=$(cd "$(dirname "$0")" && pwd)
run() {
  if [ "$(date -u +%H%M)" -ge 1730 ]; then echo "skip $1 (past 17:30 UTC) $(date -u +%FT%TZ)" >> "$here/queue.log"; return; fi
  echo "start $1 $(date -u +%FT%TZ)" >> "$here/queue.log"
  "$here/run.sh" "$@"
  echo "end $1 $(date -u +%FT%TZ)" >> "$here/queue.log"
}
run fit_notail_skipinv_final_ret1b notail_skipinv upstream:ret=1b,pmu=64,ckpt=final fit 16 256
run check_notail_skipinv_final_ret1b notail_skipinv upstream:ret=1b,pmu=64,ckpt=final check 16 256
run fit_notail_skipinv_final_ret2b notail_skipinv upstream:ret=2b,pmu=64,ckpt=final fit 16 256
run check_notail_skipinv_final_ret2b notail_skipinv upstream:ret=2b,pmu=64,ckpt=final check 16 256
run fit_notail_skipinv_ckpt_ret0 notail_skipinv upstream:pmu=64,ckpt fit 16 256
run check_notail_skipinv_ckpt_ret0 notail_skipinv upstream:pmu=64,ckpt check 16 256
