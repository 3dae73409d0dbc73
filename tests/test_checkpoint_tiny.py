"""make-tiny: every canonical tensor, non-trivial values, and a forward pass (transformers) that exercises
the SwiGLU clamp while its logits stay finite and sane."""

from __future__ import annotations

import torch

import ckpt_fixtures as fx
from dsv4.checkpoint.canonical import open_checkpoint
from dsv4.checkpoint.spec import APE, GATE_BIAS, HC, NORM, SINK, TID2EID, model_specs
from dsv4.checkpoint.tiny import random_canonical


def test_every_canonical_tensor_in_its_release_dtype():
    cfg = fx.tiny_config()
    ref = fx.reference()
    specs = model_specs(cfg)
    assert set(ref) == {s.name for s in specs}
    assert any(n.startswith("mtp.0.") for n in ref)
    for s in specs:
        assert ref[s.name].dtype == s.dtype and tuple(ref[s.name].shape) == s.shape, s.name


def test_values_are_not_trivial():
    cfg = fx.tiny_config()
    ref = fx.reference()
    for s in model_specs(cfg):
        t = ref[s.name]
        if s.role == TID2EID:
            assert int(t.min()) >= 0 and int(t.max()) < cfg.n_routed_experts
            assert all(len(set(row.tolist())) == cfg.num_experts_per_tok for row in t)  # distinct experts per token
            assert len(set(t[:, 0].tolist())) == cfg.n_routed_experts  # every expert is used
            continue
        t = t.float()
        assert torch.isfinite(t).all(), s.name
        if s.role == NORM:
            assert (t != 1).all() and (t - 1).abs().max() <= 0.21, s.name
        elif s.role in (SINK, APE, GATE_BIAS, HC):
            assert (t != 0).all() and t.std() > 0.01 if t.numel() > 1 else t.item() != 0, s.name
        else:
            assert t.std() > 0, s.name
    assert (ref["layers.2.hc_attn_scale"] != 1).all() and (ref["hc_head_scale"] != 1).all()


def test_seeded():
    cfg = fx.tiny_config()
    again = random_canonical(cfg, 0)
    other = random_canonical(cfg, 1)
    assert all(torch.equal(again[n], t) for n, t in fx.reference().items())
    assert not torch.equal(other["layers.0.attn.wq_a.weight"], again["layers.0.attn.wq_a.weight"])


def test_make_tiny_writes_what_random_canonical_makes():
    ckpt = open_checkpoint(fx.tiny())
    ref = fx.reference()
    assert ckpt.dialect == "deepseek" and ckpt.config == fx.tiny_config()
    assert set(ckpt.tensors) == set(ref)
    assert len(set(ckpt.sources.values())) > 1  # sharded
    for name, t in ckpt.tensors.items():
        assert torch.equal(t.load(), ref[name]), name


def test_forward_hits_the_clamp_and_stays_sane():
    """Measured with transformers' model (the oracle), on 300 tokens (HCA entries appear past 128)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    model = fx.hf_model()
    cfg = fx.tiny_config()
    limit = cfg.swiglu_limit
    hits = {k: [0, 0] for k in ("routed gate", "routed up", "shared gate", "shared up")}

    def count(kind: str, gate: torch.Tensor, up: torch.Tensor) -> None:
        hits[f"{kind} gate"][0] += int((gate > limit).sum())
        hits[f"{kind} gate"][1] += gate.numel()
        hits[f"{kind} up"][0] += int((up.abs() > limit).sum())
        hits[f"{kind} up"][1] += up.numel()

    handles = []
    for module in model.modules():
        if isinstance(module, hf.DeepseekV4Experts):
            def experts_hook(mod, args, out):
                x, idx = args[0], args[1]
                for e in idx.unique().tolist():
                    rows = (idx == e).any(-1)
                    gate, up = torch.nn.functional.linear(x[rows], mod.gate_up_proj[e]).chunk(2, dim=-1)
                    count("routed", gate, up)
            handles.append(module.register_forward_hook(experts_hook))
        elif isinstance(module, hf.DeepseekV4MLP):
            def mlp_hook(mod, args, out):
                count("shared", mod.gate_proj(args[0]), mod.up_proj(args[0]))
            handles.append(module.register_forward_hook(mlp_hook))
    ids = torch.randint(0, cfg.vocab_size, (2, 300), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    fractions = {k: a / b for k, (a, b) in hits.items()}
    print("SwiGLU clamp hit fractions:", {k: round(v, 3) for k, v in fractions.items()})
    for kind, frac in fractions.items():
        assert 0.05 < frac < 0.5, (kind, frac)
    assert torch.isfinite(logits).all()
    assert 0.5 < logits.std() < 10 and logits.abs().max() < 100
    assert logits.argmax(-1).unique().numel() > 50  # not collapsed onto a few tokens
