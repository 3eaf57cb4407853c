"""Compile chunk_states_kernel for sm_90 without a GPU; print loop-structure facts."""
import importlib.util, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

path = sys.argv[1]
spec = importlib.util.spec_from_file_location("kmod", path)
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
fn = mod.chunk_states_kernel
names = fn.arg_names
sig = {}
ptr = {"k": "*bf16", "v": "*bf16", "w": "*bf16", "v_new": "*bf16", "g": "*fp32", "h": "*bf16",
       "h0": "*fp32", "ht": "*fp32", "cu_seqlens": "*i32", "chunk_offsets": "*i64",
       "chunk_map": "*i64", "slots": "*i64", "cache": "*fp32", "row_ckpt": "*i64"}
const = dict(H=32, Hg=16, K=128, V=128, BT=64, BV=32, USE_INITIAL_STATE=True, STORE_FINAL_STATE=True)
for n in names:
    if n in const:
        sig[n] = "constexpr"
    elif n in ptr:
        sig[n] = ptr[n]
    else:
        sig[n] = "i64"
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in ptr}
src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
ck = triton.compile(src, target=GPUTarget("cuda", 90, 128), options={"num_warps": 4, "num_stages": 3})
ptx = ck.asm["ptx"]
open(sys.argv[2], "w").write(ptx)
print("n_regs?", getattr(ck, "n_regs", None))
lines = ptx.splitlines()
for i, l in enumerate(lines):
    if re.search(r"^\$L__BB|ld\.global\.(b64|b32) |bra|wgmma.wait|bar.sync|cp.async.wait|st\.global", l):
        print(i, l.strip()[:80])
