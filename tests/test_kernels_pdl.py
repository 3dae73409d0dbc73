"""Programmatic dependent launch in the decode GEMV (`GemvConfig.pdl`).

The interpreter cannot run `griddepcontrol`, and CI has no GPU, so these tests compile `_gemv_kernel` for
sm_90 (Triton's own LLVM; no GPU needed; `bench/lab/sass.py`) in a subprocess without TRITON_INTERPRET, and read
its PTX: with PDL the kernel must trigger the next launch, and on every path from its entry (a walk over the
PTX's basic blocks) wait for the previous kernel before its first global load (x, ids, scratch), store or
atomic. Only L2 prefetches of weight bytes may come before the wait; with `X_READY` (the gate/up launch
after `moe.route`) loads of x and weights may too, but still no write. The same holds for the MoE pair in one
launch (`moe_pair._moe_pair_kernel`). The routing kernel triggers first thing.
The H200 check that a chain of dependent GEMVs gives the same bits with and without PDL is in
bench/run_all.py.
"""

import pytest
import torch

from dsv4.kernels import gemv_launch
from dsv4.kernels.policy import GemvConfig
from kernel_util import compile_in_subprocess

# compiles the kernel (NVFP4 routed weights, 2 warps, MMA N = 8; an FP8 shared expert where asked) through
# bench/lab/sass.py's compile_gemv and prints, per case, the PTX lines that matter
_COMPILE = r"""
import json, re, sys
sys.path.insert(0, "bench/lab")
import sass

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dsv4.kernels import moe

READ = re.compile(r"\b(ld\.global|cp\.async\.[a-z.]*global|ld\.volatile)")
WRITE = re.compile(r"\b(st\.global|atom\.|red\.)")
LABEL = re.compile(r"^(\$\w+):$")
BRANCH = re.compile(r"^(@!?%\w+\s+)?bra(\.uni)?\s+(\$\w+);")


def kind(line):
    if "griddepcontrol.wait" in line:
        return "wait"
    if "griddepcontrol.launch_dependents" in line:
        return "trigger"
    if "prefetch.global.L2" in line:
        return "prefetch"
    return "write" if WRITE.search(line) else "read" if READ.search(line) else None


# the kinds of instruction (read, write, prefetch, trigger) on some path from the kernel's entry that has not
# passed a griddepcontrol.wait: a walk over the PTX's basic blocks (labels, branches, fall-through)
def before_wait(lines):
    blocks, succ, cur, open_ = [[]], [[]], 0, True
    for l in lines:
        m = LABEL.match(l)
        if m:
            blocks.append([]), succ.append([])
            if open_:
                succ[cur].append(m.group(1))
            cur, open_ = len(blocks) - 1, True
            blocks[cur].append(m.group(1) + ":")
            continue
        if not open_:
            continue   # unreachable until the next label
        blocks[cur].append(l)
        b = BRANCH.match(l)
        if b:
            succ[cur].append(b.group(3))
            open_ = b.group(1) is not None   # a predicated branch falls through, into a block of its own
            if open_:
                blocks.append([]), succ.append([])
                succ[cur].append(len(blocks) - 1)
                cur = len(blocks) - 1
        elif l.startswith("ret;") or l.startswith("exit;"):
            open_ = False
    index = {blk[0][:-1]: i for i, blk in enumerate(blocks) if blk and blk[0].endswith(":")}
    seen, todo, kinds = set(), [0], set()
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        waited = False
        for l in blocks[i]:
            k = kind(l)
            if k == "wait":
                waited = True
                break
            if k:
                kinds.add(k)
        if not waited:
            todo += [index.get(t, t) for t in succ[i]]   # a label, or a fall-through block's index
    return sorted(kinds)


def summary(k):
    lines = [l.split("//")[0].strip() for l in k.asm["ptx"].splitlines()]
    lines = [l for l in lines if l]
    count = lambda what: sum(kind(l) == what for l in lines)
    return dict(before_wait=before_wait(lines), first=next((kind(l) for l in lines if kind(l)), None),
                waits=count("wait"), triggers=count("trigger"),
                reads=count("read"), writes=count("write"), prefetches=count("prefetch"),
                launch_pdl=bool(getattr(k.metadata, "launch_pdl", False)))


out = {}
for name, rows, pdl, tiled, shared, x_ready in json.loads(sys.argv[1]):
    out[name] = summary(sass.compile_gemv("nvfp4", 2, 64, 2, rows, rows == 1, 128, mp=8,
                                          shared="fp8" if shared else None, tiled=tiled, pdl=pdl,
                                          x_ready=x_ready))
for name, x_ready in (("pair", False), ("pair, shared first", True)):
    out[name] = summary(sass.compile_pair("nvfp4", "fp8", pdl=True, x_ready=x_ready))
fn = moe._route_kernel
consts = dict(TOPK=6, E_PAD=256, K_PAD=8, HASH=False, PDL=True)
sig = {n: "constexpr" if n in consts else "*fp32" if n.endswith("_ptr") else "i32" for n in fn.arg_names}
sig["scaling"] = "fp32"
out["route"] = summary(triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": 1}))
from dsv4.kernels import mhc, norm_rope
for pdl in (True, False):
    fn = norm_rope._norm_rope_kernel
    rows = norm_rope.Rows("*bf16", "*bf16", "*fp32", "*fp32", "*fp32", "i32", "i32", "i32", "i32", "i32", "i32",
                          "fp32")
    sig = dict(A=rows, B=rows, first_b="i32", LA="constexpr", LB="constexpr")
    consts = dict(LA=norm_rope.Shape(1024, 1024, 2, 0, False, 0, pdl, 8),
                  LB=norm_rope.Shape(512, 512, 2, 32, False, 0, pdl, 8))
    out[f"norm_rope pdl={pdl}"] = summary(triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                                                         options={"num_warps": 4}))
    fn = mhc._finish_kernel
    consts = dict(ITERS=20, N=4, RP=32, CP=64, HEAD=False, BD=4096, NORM=True, PDL=pdl)
    sig = {n: "constexpr" if n in consts else "*fp32" if n.endswith("_ptr") else "i32" for n in fn.arg_names}
    sig.update(x_ptr="*bf16", u_ptr="*bf16", norm_eps="fp32", hc_eps="fp32", w_eps="fp32")
    out[f"finish pdl={pdl}"] = summary(triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                                                      options={"num_warps": 8}))
    from dsv4.kernels import attention
    from dsv4.kernels.steps import StepTokens
    tensors = attention.Tensors(*(["*bf16"] * 4 + ["*i32", "*fp32", "*bf16", "*fp32", "*fp32", "*fp32", "*fp32"]))
    strides = attention.Strides(*(["i32"] * 9))
    shape = attention.Shape(128, 512, 64, 512, 4, 16, 32, tl.bfloat16, 4, True, 0, 1, 32, pdl)
    sig = dict(T=tensors, steps=StepTokens(*(["*i32"] * 6)), S=strides, H="i32", scale="fp32", q_eps="fp32",
               L="constexpr")
    out[f"attention pdl={pdl}"] = summary(triton.compile(ASTSource(attention._attention_kernel, sig, dict(L=shape)),
                                                         target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}))
    consts = dict(SPLIT=4, D=512, BH=8, UNROLL=4, HALF_ROPE=32, PDL=pdl)
    sig = dict(T=tensors, S=strides, H="i32", **{k: "constexpr" for k in consts})
    out[f"combine pdl={pdl}"] = summary(triton.compile(ASTSource(attention._combine_kernel, sig, consts),
                                                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}))
print("RESULT " + json.dumps(out))
"""

CASES = [("dense tiled", 0, True, True, False, False), ("dense row-major", 0, True, False, False, False),
         ("moe pair + shared", 1, True, True, True, False), ("moe token", 2, True, True, False, False),
         ("dense tiled, no pdl", 0, False, True, False, False),
         ("moe pair + shared, shared first", 1, True, True, True, True)]


@pytest.fixture(scope="module")
def ptx():
    return compile_in_subprocess(_COMPILE, CASES)


@pytest.mark.parametrize("case", [c[0] for c in CASES if c[2] and not c[5]])
def test_pdl_waits_before_the_first_global_access(ptx, case):
    """On every path from the entry, nothing but the trigger and L2 prefetches before the wait."""
    r = ptx[case]
    assert r["launch_pdl"], "the kernel must be launched with the PDL attribute"
    assert r["triggers"] == 1 and r["waits"] == 1 and r["reads"] and r["writes"], r
    assert set(r["before_wait"]) <= {"trigger", "prefetch"} and "trigger" in r["before_wait"], r


def test_pdl_prefetches_only_dense_tiled_units_before_the_wait(ptx):
    assert "prefetch" in ptx["dense tiled"]["before_wait"]
    # row-major weights and the MoE modes (whose expert ids another kernel writes) prefetch nothing
    for case in ("dense row-major", "moe pair + shared", "moe token"):
        assert ptx[case]["prefetches"] == 0, case


def test_no_pdl_means_no_griddepcontrol(ptx):
    r = ptx["dense tiled, no pdl"]
    assert r["triggers"] == r["waits"] == r["prefetches"] == 0 and not r["launch_pdl"], r


def test_shared_first_reads_before_the_wait_but_never_writes(ptx):
    """`launch(x_ready=True)`: the shared expert's units read x and their weights before the routing kernel has
    finished, but no path writes (h, the workspace, the semaphores) before a wait; routed units wait before
    they read the expert ids (the second wait: one per unit, before it loads ids, and one before its writes)."""
    r = ptx["moe pair + shared, shared first"]
    assert r["launch_pdl"] and r["triggers"] == 1 and r["waits"] == 2, r
    assert "read" in r["before_wait"] and "write" not in r["before_wait"], r


def test_the_pair_in_one_launch_waits_like_its_two_launches(ptx):
    """`moe_pair.launch_pair` in one launch: with PDL it triggers and waits before any global access, unless the
    gate/up part streams the shared expert first (`x_ready`), where it reads before the wait but never writes -
    its tickets and h-row flags included, which it only touches after a wait."""
    plain, first = ptx["pair"], ptx["pair, shared first"]
    for r in (plain, first):
        assert r["launch_pdl"] and r["triggers"] == 1 and r["reads"] and r["writes"], r
    assert set(plain["before_wait"]) == {"trigger"}, plain
    assert "read" in first["before_wait"] and "write" not in first["before_wait"], first


@pytest.mark.parametrize("bad", [3, 6, -1])
def test_pdl_prefetch_must_be_a_power_of_two(bad):
    with pytest.raises(ValueError, match="pdl_l2"):
        GemvConfig(pdl_l2=bad)
    assert GemvConfig(pdl_l2=0).pdl_l2 == 0 and GemvConfig(pdl_l2=8).pdl_l2 == 8


def test_pdl_is_off_where_it_cannot_run():
    cfg = GemvConfig()
    assert cfg.pdl, "PDL is the default"
    assert not gemv_launch.pdl_enabled(cfg, torch.device("cpu"))
    assert not gemv_launch.pdl_enabled(GemvConfig(pdl=False), torch.device("cpu"))


def test_route_kernel_triggers_its_dependents_first(ptx):
    """With PDL the routing kernel triggers its dependents before it touches memory, so
    `moe(after_route=True)`'s gate/up launch can stream the shared expert meanwhile; it waits for nothing."""
    r = ptx["route"]
    assert r["first"] == "trigger" and r["triggers"] == 1 and r["waits"] == 0 and r["reads"] and r["writes"], r


@pytest.mark.parametrize("kernel", ["norm_rope", "finish", "attention", "combine"])
def test_the_kernels_before_decode_gemvs_trigger_them_first(ptx, kernel):
    """The norm / rope launch, mHC's finish and the attention launch or its combine (which make the x of wq_a, wq_b,
    wkv and wo_a) let the next launch start first thing with PDL on: that GEMV's wait covers them, and it
    L2-prefetches its weights meanwhile. They are launched without the attribute themselves, so they wait for
    nothing; without PDL, no griddepcontrol."""
    on, off = ptx[f"{kernel} pdl=True"], ptx[f"{kernel} pdl=False"]
    assert on["first"] == "trigger" and on["triggers"] == 1 and on["waits"] == 0 and not on["launch_pdl"], on
    assert on["reads"] and on["writes"], on
    assert off["triggers"] == off["waits"] == 0 and off["reads"] and off["writes"], off
