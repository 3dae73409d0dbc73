"""The `dsv4` command line: make-tiny, convert and inspect, in-process (plus one real `python -m dsv4`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt_fixtures as fx
from dsv4 import cli
from dsv4.checkpoint.canonical import open_checkpoint
from dsv4.checkpoint.writer import FORMATS, NAMINGS

ROOT = Path(__file__).resolve().parents[1]


def test_choices_match_the_writer():
    from dsv4.api import _DTYPES
    from dsv4.runtime.cache import KV_CACHE_DTYPES
    assert cli.FORMATS == FORMATS and cli.NAMINGS == NAMINGS and cli.KV_CACHE_DTYPES == KV_CACHE_DTYPES
    assert set(cli.DTYPES) - {"auto"} <= set(_DTYPES)


@pytest.mark.parametrize("argv,culprit", [
    (["generate", "--model", "demo", "--dtype", "float8", "hi"], "--dtype"),
    (["inspect", "x", "--disable-custom-all-reduce"], "--disable-custom-all-reduce"),
])
def test_bad_options_are_usage_errors(argv, culprit, capsys):
    """Refused by the parser (exit status 2, the option named), before any model is loaded."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and culprit in capsys.readouterr().err


def test_hf_overrides_without_dummy_weights_is_an_error_line(capsys):
    """LLM refuses hf_overrides for a checkpoint before it loads anything; the CLI prints that as one error line
    naming the option (exit status 1), not a traceback."""
    assert cli.main(["generate", "--model", "demo", "--hf-overrides", '{"num_hidden_layers": 2}', "hi"]) == 1
    err = capsys.readouterr().err
    assert "dsv4 generate: error: hf_overrides applies to load_format='dummy' only" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("text,value", [("4GB", 4 * 1024**3), ("4GiB", 4 * 1024**3), ("500MB", 500 * 1024**2),
                                        ("1048576", 1048576), ("1.5k", 1536), ("300KB", 300 * 1024)])
def test_shard_size(text, value):
    assert cli._size(text) == value


def test_make_tiny_convert_inspect(capsys):
    d = fx.fresh_dir("cli")
    assert cli.main(["make-tiny", str(d / "tiny"), "--seed", "3", "--shard-size", "200KB"]) == 0
    assert "308 tensors" in capsys.readouterr().out
    tiny = open_checkpoint(d / "tiny")
    assert len(set(tiny.sources.values())) > 1
    assert not torch.equal(tiny.tensors["embed.weight"].load(), fx.reference()["embed.weight"])  # seed 3, not 0

    assert cli.main(["convert", str(d / "tiny"), str(d / "nv"), "--format", "nvfp4-experts", "--naming", "hf",
                     "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "dialect hf-experts" in out and "nvfp4 quantized" in out
    assert (d / "nv" / "hf_quant_config.json").exists()

    assert cli.main(["inspect", str(d / "nv")]) == 0
    out = capsys.readouterr().out
    assert "dialect   hf-experts" in out and "routed experts" in out and "nvfp4" in out
    assert "no problems found" in out and "582,623 present of 582,623" in out


def test_inspect_lists_refusals_and_fails(capsys):
    out = fx.copy_checkpoint(fx.tiny(), "cli-broken")
    cfg = json.loads((out / "config.json").read_text())
    cfg["hidden_size"] = 32
    (out / "config.json").write_text(json.dumps(cfg))
    assert cli.main(["inspect", str(out)]) == 1
    text = capsys.readouterr().out
    assert "REFUSED" in text and "'layers.0.attn.wq_a.weight'" in text
    assert cli.main(["inspect", str(out / "nothing-here")]) == 1
    assert "no such file or folder" in capsys.readouterr().out


def test_inspect_transformers_save_notes_the_missing_mtp(capsys):
    assert cli.main(["inspect", str(fx.hf_saved())]) == 0
    text = capsys.readouterr().out
    assert "dialect   hf-saved" in text and "no MTP block" in text


def test_errors_are_one_line_not_a_traceback(capsys):
    assert cli.main(["convert", str(fx.fresh_dir("empty")), str(fx.fresh_dir("o")), "--format", "bf16"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dsv4 convert: error:") and "Traceback" not in err


def test_python_dash_m_and_a_light_help():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "dsv4", "make-tiny", "--help"], capture_output=True, text=True,
                          env=env, cwd=ROOT)
    assert done.returncode == 0 and "--seed" in done.stdout and "nvfp4-experts" in done.stdout
    # --help must not pay for torch: each subcommand imports its machinery when it runs
    probe = "import sys, dsv4.cli; dsv4.cli._parser(); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.stdout.strip() == "False", done.stderr


def test_inspect_audit_runs_the_loader_audit(capsys):
    assert cli.main(["inspect", str(fx.tiny("nvfp4-experts")), "--audit"]) == 0
    text = capsys.readouterr().out
    assert "audit: 0 finding(s), 0 refused" in text
    out = fx.copy_checkpoint(fx.tiny(), "cli-zero")
    from safetensors import safe_open
    from safetensors.torch import save_file

    shard = out / json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]["layers.1.attn.attn_sink"]
    with safe_open(str(shard), "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    tensors["layers.1.attn.attn_sink"] = torch.zeros_like(tensors["layers.1.attn.attn_sink"])
    save_file(tensors, shard)
    assert cli.main(["inspect", str(out), "--audit"]) == 1
    text = capsys.readouterr().out
    assert "REFUSED" in text and "attn_sink" in text and "all zero" in text


# ------------------------------------------------------------------------------------------ generate / chat
def test_generate_streams_the_demo_model(capsys, monkeypatch):
    import runtime_fixtures as rf
    from dsv4 import LLM, SamplingParams

    monkeypatch.setenv("DSV4_CACHE", str(rf.demo_root()))          # `--model demo` finds it there
    args = ["generate", "--model", "demo", "DeepSeek-V4 is", "--max-tokens", "8", "--temperature", "0"]
    assert cli.main(args) == 0
    captured = capsys.readouterr()
    want = LLM("demo", progress=False).generate("DeepSeek-V4 is", SamplingParams(temperature=0, max_tokens=8))
    assert captured.out == want[0].outputs[0].text + "\n" and captured.out.strip()
    assert "loading" in captured.err                                 # the progress bar, on stderr


def test_async_scheduling_reaches_the_engine(monkeypatch):
    import runtime_fixtures as rf

    monkeypatch.setenv("DSV4_CACHE", str(rf.demo_root()))
    for flag, want in (([], True), (["--no-async-scheduling"], False), (["--async-scheduling"], True)):
        args = cli._parser().parse_args(["generate", "--model", "demo", "--no-progress", "hi", *flag])
        with cli._llm(args) as llm:
            assert llm.engine.async_scheduling is want


def test_chat_keeps_and_resets_the_conversation(capsys, monkeypatch):
    import runtime_fixtures as rf
    from dsv4.api import LLM

    monkeypatch.setenv("DSV4_CACHE", str(rf.demo_root()))
    lines = iter(["hi", "more", "/reset", "again"])

    def fake_input(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None
    monkeypatch.setattr("builtins.input", fake_input)
    prompts, stream = [], LLM.stream

    def recording(self, prompt, params=None):
        prompts.append(prompt)
        return (yield from stream(self, prompt, params))
    monkeypatch.setattr(LLM, "stream", recording)
    assert cli.main(["chat", "--model", "demo", "--max-tokens", "4", "--temperature", "0", "--system", "S",
                     "--no-progress"]) == 0
    replies = capsys.readouterr().out.splitlines()
    assert len(prompts) == len(replies) == 3
    assert prompts[0].startswith("<｜begin▁of▁sentence｜>S<｜User｜>hi<｜Assistant｜></think>")
    assert prompts[1].startswith(prompts[0]) and replies[0] in prompts[1] and prompts[1].endswith(
        "<｜User｜>more<｜Assistant｜></think>")
    assert prompts[2] == "<｜begin▁of▁sentence｜>S<｜User｜>again<｜Assistant｜></think>"


def test_generate_errors_are_one_line(capsys, monkeypatch):
    import runtime_fixtures as rf

    monkeypatch.setenv("DSV4_CACHE", str(rf.demo_root()))
    assert cli.main(["generate", "--model", "demo", "a b c d e f g h", "--max-model-len", "4", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "dsv4 generate: error: request '0': the prompt has" in err and "Traceback" not in err
    assert cli.main(["generate", "--model", str(fx.fresh_dir("nothing")), "x", "--no-progress"]) == 1
    assert capsys.readouterr().err.startswith("dsv4 generate: error:")
