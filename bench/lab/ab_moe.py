"""Question: Is this tree's MoE decode pair faster than another commit's, measured on the same machine?

Same-machine A/B of the MoE decode pair: this tree's kernels against another commit's, interleaved.

    python bench/lab/ab_moe.py --export COMMIT DIR      # here, with git: COMMIT's package as DIR/dsv4_ref
    python bench/lab/ab_moe.py --ref DIR [--tokens 1,4,8] [--repeats 3] [--layer]      # on the GPU

`--layer` times the routing kernel and the package's MoE op instead of the bare pair, each package twice: as
`model.moe` runs it (`after_route=True`: gate/up streams the shared expert while routing runs; sides "ref" and
"new") and without that overlap ("ref plain", "plain"); both with the package's side stream for the shared expert
(`dispatch.Side`), if it has one. Compare like with like: new/ref and plain/ref plain. (Until
round fourteen the reference ran only without the overlap, so new/ref credited a change with the overlap's 1-2 %.)

Calls on the device tool can land on different H200s (copy bandwidth 4249 vs 4274 GB/s), so a change worth a
few percent is only measured against its predecessor in one process. Both packages get the same weights, inputs
and routings (made by this tree's `bench/common.py`); each repeat times the reference pair, then this tree's,
each as two launches (gate/up over (token, slot) pairs with the FP8 shared expert, then down with the routing
weights and the top-k sum), and the outputs are compared.
"""

from __future__ import annotations

import argparse
import importlib
import io
import itertools
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import FLASH, PRO, TOY, bench_start, moe_decode_inputs, nbytes, random_qweight  # noqa: E402

from dsv4.kernels import refuse_fallback  # noqa: E402


def export(commit: str, out: Path):
    """COMMIT's `dsv4` package as out/dsv4_ref (its absolute self-imports renamed)."""
    tar = subprocess.run(["git", "archive", commit, "dsv4"], cwd=ROOT, check=True, capture_output=True).stdout
    dest = out / "dsv4_ref"
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        for m in t.getmembers():
            if m.isfile() and m.name.endswith(".py"):
                path = dest / Path(m.name).relative_to("dsv4")
                path.parent.mkdir(parents=True, exist_ok=True)
                text = t.extractfile(m).read().decode()
                path.write_text(text.replace("from dsv4.", "from dsv4_ref.")
                                .replace("import dsv4.", "import dsv4_ref."))
    print(f"{commit} -> {dest}")


def entry_points(package: str) -> SimpleNamespace:
    """The MoE entry points of a dsv4 package (`dsv4` or an exported `dsv4_ref`), in this tree's layout
    (kernels.dispatch / policy / gemv_launch / host) or the one before it (kernels.moe.moe, kernels.gemv)."""
    def mod(name):
        return importlib.import_module(f"{package}.kernels{name}")

    try:
        policy, launcher, dispatch, host = mod(".policy"), mod(".gemv_launch"), mod(".dispatch"), mod(".host")
        moe, scratch = dispatch, host.Scratch
    except ModuleNotFoundError:   # before kernels.policy: every piece in gemv / gemm / moe
        policy = launcher = mod(".gemv")
        moe, scratch = mod(".moe"), mod(".gemm").Scratch
    return SimpleNamespace(GemvConfig=policy.GemvConfig, ROWS_PAIR=policy.ROWS_PAIR, ROWS_TOKEN=policy.ROWS_TOKEN,
                           launch=launcher.launch, route=mod(".moe").route, moe=moe.moe,
                           Side=getattr(moe, "Side", None), Scratch=scratch, Ops=mod("").Ops)


def pair(mod, x, w13, w2, sw13, sw2, ids, rw, h, out, k, scratch):
    """The MoE decode pair as two launches of package `mod`'s GEMV (no PDL; `--layer` times the package's MoE op
    itself, which may run the pair as one launch: `moe_pair.launch_pair`)."""
    T, P = x.shape[0], ids.numel()
    cfg = mod.GemvConfig(pdl=False)
    mod.launch(x, w13, h, cfg, M=P + T, rows=mod.ROWS_PAIR, R=P + T, gated=True, x_div=k, ids=ids, limit=10.0,
               shared=sw13, pairs=P, scratch=scratch)
    mod.launch(h, w2, out, cfg, M=T, rows=mod.ROWS_TOKEN, R=T, topk=k, ids=ids, rw=rw, shared=sw2, pairs=P,
               scratch=scratch)


def side_of(pkg: SimpleNamespace) -> dict:
    """`moe`'s side-stream keyword for a package, if it has one (strict: no reference fallbacks)."""
    return {"side": pkg.Side(refuse_fallback, refuse_fallback)} if pkg.Side is not None else {}


def layer(mod, x, logits, bias, w13, w2, sw13, sw2, k, scratch, **kwargs):
    """The routing kernel, then the MoE with its shared expert, through package `mod`'s MoE op."""
    wts, ids = mod.route(logits, bias, k, 1.5, fallback=refuse_fallback)
    return mod.moe(x, ids, wts, w13, w2, 10.0, fallback=refuse_fallback, shared=(sw13, sw2), scratch=scratch,
                   **kwargs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--export", nargs=2, metavar=("COMMIT", "DIR"))
    ap.add_argument("--ref", help="a folder holding dsv4_ref (from --export)")
    ap.add_argument("--tokens", default="1,4,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layer", action="store_true",
                    help="routing + the MoE op instead of the bare pair; adds this tree without after_route")
    ap.add_argument("--fmts", default="nvfp4", help="the routed experts' formats, e.g. nvfp4,mxfp4")
    ap.add_argument("--toy", action="store_true", help="CPU interpreter dry run at toy shapes (checks the script)")
    args = ap.parse_args()
    if args.export:
        return export(args.export[0], Path(args.export[1]))
    sys.path.insert(0, str(Path(args.ref).resolve()))
    ref, new = entry_points("dsv4_ref"), entry_points("dsv4")
    # --layer: where the shared expert runs beside the routed experts (above 8 tokens), each package's own kernels,
    # as its model runs them (`Ops.triton`), and on a second stream where the package has one (`Side`)
    ref_mlp = {"mlp_op": ref.Ops.triton(strict=True).mlp, **side_of(ref)} if args.layer else {}
    new_mlp = {"mlp_op": new.Ops.triton(strict=True).mlp, **side_of(new)} if args.layer else {}
    # name: (package, moe keyword arguments, scratch)
    overlap = {"after_route": True} if args.layer else {}
    sides = {"ref": (ref, {**overlap, **ref_mlp}, ref.Scratch()), "new": (new, {**overlap, **new_mlp}, new.Scratch())}
    if args.layer:
        sides["ref plain"] = (ref, ref_mlp, ref.Scratch())
        sides["plain"] = (new, new_mlp, new.Scratch())
    dev, gen, timer, copy = bench_start(args.toy)
    for s, fmt in itertools.product((TOY,) if args.toy else (FLASH, PRO), args.fmts.split(",")):
        w13 = random_qweight(fmt, (s.E, 2), s.I, s.D, dev, gen)
        w2 = random_qweight(fmt, (s.E,), s.D, s.I, dev, gen)
        sw13 = random_qweight("fp8", (2,), s.I, s.D, dev, gen)
        sw2 = random_qweight("fp8", (), s.D, s.I, dev, gen)
        for T in (int(t) for t in args.tokens.split(",")):
            rot = 2 if args.toy else 8
            xs, ids, rws, hs, outs, touched = moe_decode_inputs(s, T, rot, dev, gen)
            logits = [torch.randn(T, s.E, device=dev, generator=gen) for _ in range(rot)]
            bias = torch.zeros(s.E, device=dev)
            if args.layer:   # the routings' own experts
                touched = sum(new.route(lg, bias, s.k, 1.5)[1].unique().numel() for lg in logits) / rot
            floor_bytes = touched * (nbytes(w13) + nbytes(w2)) / s.E + nbytes(sw13) + nbytes(sw2)

            def call(name, i):
                pkg, kw, scratch = sides[name]
                if args.layer:
                    return layer(pkg, xs[i], logits[i], bias, w13, w2, sw13, sw2, s.k, scratch, **kw)
                pair(pkg, xs[i], w13, w2, sw13, sw2, ids[i], rws[i], hs[i], outs[i], s.k, scratch)
                return outs[i]

            got = {name: call(name, 0).float().clone() for name in sides}
            diffs = "  ".join(f"{name} {float((y - got['ref']).norm() / got['ref'].norm()):.1e}"
                              for name, y in got.items() if name != "ref")
            times = {name: [] for name in sides}
            for _ in range(args.repeats):
                for name in sides:
                    times[name].append(1e3 * timer.per_call_ms([lambda i=i, name=name: call(name, i)
                                                                for i in range(rot)]))
            row = "  ".join(f"{name} {min(v):7.1f}-{max(v):7.1f} us "
                            f"({100 * floor_bytes / (min(v) * 1e-6) / 1e9 / copy:3.0f}%)" for name, v in times.items())
            pairs = [("new", "ref")] + [("plain", "ref plain")] * args.layer
            ratios = "  ".join(f"{a}/{b} {min(times[a]) / min(times[b]):.3f}" for a, b in pairs)
            print(f"{s.name:8s} {fmt:5s} T={T:<3d} {row}  {ratios}  rel. diff to ref: {diffs}", flush=True)


if __name__ == "__main__":
    main()
