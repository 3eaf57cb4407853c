#!/bin/bash
# checkpoint_invalid: which clause of vLLM's is_mamba_prefill_checkpoint_valid fails at the
# prompt's final chunk (diag_ckinv.py; observation only), check part, ret=2b,ckpt=final
cd "$(dirname "$0")"
./run_diag.sh diag_check_plain_pmu64_final_ret2b plain upstream:ret=2b,pmu=64,ckpt=final check
./run_diag.sh diag_check_two_notail_pmu64_final_ret2b two_notail upstream:ret=2b,pmu=64,ckpt=final check
