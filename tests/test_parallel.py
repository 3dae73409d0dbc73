"""Several ranks on the CPU (gloo worker processes): tensor, expert and pipeline parallelism give what one process
gives, a layout the model cannot take is refused before anything loads, and a killed worker ends the run with an
error naming it.

The process tests run the tiny model's "wide" variant (runtime_fixtures: the indexer picks every visible entry, so
no top-k tie between nearly equal scores decides anything) on a ragged batch: three prompts of 5, 17 and 40 tokens
prefilled together, then decoded together. fp32 logits of every step (the vocabulary-split head gathered on rank 0)
are compared with one process's within 1e-5 (tensor parallelism sums wo_b's and the experts' partial products in
another order; pipeline parallelism changes nothing and is compared exactly), and `LLM.generate` must give the same
greedy tokens. The unit tests check the slicing (every rank's buffers are the slices of the one-process model's),
the plan of a whole layout, and the step message.
"""

import os
import signal
import threading
import time

import pytest
import torch

import ckpt_fixtures as fx
import dsv4
import runtime_fixtures as rf
from dsv4.checkpoint.canonical import open_checkpoint
from dsv4.checkpoint.dummy import dummy_model
from dsv4.checkpoint.loader import layout_plan, load
from dsv4.checkpoint.shards import check_tiling, region
from dsv4.cli import main as cli
from dsv4.config import ModelConfig
from dsv4.model.state import SeqBatch
from dsv4.parallel import Layout, LayoutError, Split
from dsv4.runtime.cache import KVCache
from dsv4.runtime.params import SamplingParams
from dsv4.runtime.spmd import StepInputs, WorkerFailure, micro_batch_bounds

PROMPTS = [rf.prompt_ids(n, seed=n) for n in (5, 17, 40)]
STEPS = 6
LAYOUTS = {"tp2": dict(tensor_parallel_size=2), "tp2-ep": dict(tensor_parallel_size=2, enable_expert_parallel=True),
           "pp2": dict(pipeline_parallel_size=2), "tp2xpp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2)}
ENGINE = dict(device="cpu", skip_tokenizer_init=True, max_num_seqs=3, max_model_len=512, num_cache_pages=8,
              progress=False)
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)


def greedy_steps(step, reset=None) -> tuple[list[list[int]], torch.Tensor]:
    """PROMPTS prefilled as one ragged step (slots 0-2, two pages each), then STEPS - 1 decode steps of all three,
    each feeding the argmax; `step(ids, batch, rows) -> logits`. Returns the tokens and every step's fp32 logits."""
    for slot in range(len(PROMPTS)) if reset else ():
        reset(slot)
    pages = tuple((2 * i, 2 * i + 1) for i in range(len(PROMPTS)))
    feed, starts, tokens, logits = [list(p) for p in PROMPTS], [0] * len(PROMPTS), [[] for _ in PROMPTS], []
    for _ in range(STEPS):
        lengths = [len(f) for f in feed]
        batch = SeqBatch(tuple(range(len(PROMPTS))), tuple(starts), tuple(lengths), pages)
        rows = [off + n - 1 for off, n in zip(batch.offsets, lengths)]
        out = step(torch.tensor([t for f in feed for t in f]), batch, rows).float()
        logits.append(out)
        feed = [[t] for t in out.argmax(-1).tolist()]
        starts = [s + n for s, n in zip(starts, lengths)]
        for seq, (t,) in zip(tokens, feed):
            seq.append(t)
    return tokens, torch.cat(logits)


@pytest.fixture(scope="module")
def one_process():
    """(greedy tokens, logits) of the step loop in one process, and LLM.generate's greedy tokens."""
    model = dsv4.load(rf.variant("wide"))
    cache = KVCache(model.config, 3, 8, torch.float32, "cpu")

    @torch.inference_mode()
    def step(ids, batch, rows):
        streams = model(ids[None], batch.positions()[None], cache.layers, batch)
        return model.head_logits(streams[:, rows])[0]

    tokens, logits = greedy_steps(step)
    outputs = dsv4.LLM(rf.variant("wide"), **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)
    return tokens, logits, [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_layout_gives_the_tokens_and_logits_of_one_process(layout, one_process):
    tokens, logits, generated = one_process
    with dsv4.LLM(rf.variant("wide"), **ENGINE, **layout) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == generated
        got_tokens, got_logits = greedy_steps(llm.engine.driver.step, llm.engine.driver.reset)
        if layout.get("tensor_parallel_size", 1) > 1:
            assert llm.model.layers[0].comm.path == "gloo"       # the CPU fallback: no symmetric memory here
        procs = list(llm._group.procs.values())
    assert got_tokens == tokens
    diff = float((got_logits - logits).abs().max())
    assert diff <= (1e-5 if layout.get("tensor_parallel_size", 1) > 1 else 0.0), diff
    assert [p.exitcode for p in procs] == [0] * len(procs)       # shutdown stopped every worker cleanly


def test_a_killed_worker_ends_the_run_with_an_error_naming_it():
    llm = dsv4.LLM(rf.variant("wide"), **ENGINE, tensor_parallel_size=2)
    victim = llm._group.procs[1]
    threading.Timer(0.5, os.kill, (victim.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match=rf"rank 1 \(pid {victim.pid}\) was killed by signal SIGKILL"):
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - start < 30
    with pytest.raises(WorkerFailure, match="rank 1"):                  # and at once on the next call
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    llm.shutdown()
    assert not llm.engine.has_unfinished()


def test_a_model_whose_heads_do_not_divide_is_refused_before_loading(monkeypatch):
    monkeypatch.setattr("dsv4.runtime.workers.start", lambda spec: pytest.fail("ranks started"))
    with pytest.raises(LayoutError, match=r"tensor_parallel_size=3 does not divide num_attention_heads=4"):
        dsv4.LLM(rf.variant("wide"), **ENGINE, tensor_parallel_size=3)
    with pytest.raises(LayoutError, match=r"pipeline_parallel_size=6 exceeds num_hidden_layers=5"):
        dsv4.LLM("tiny", load_format="dummy", **ENGINE, pipeline_parallel_size=6)
    with pytest.raises(LayoutError, match=r"a fp8 scale stores 128 elements of axis 0 per index"):
        dsv4.LLM("tiny", load_format="dummy-official", **ENGINE, tensor_parallel_size=2)


def test_the_command_line_generates_the_same_text_on_two_ranks(capsys, monkeypatch):
    monkeypatch.setenv("DSV4_CACHE", str(rf.demo_root()))          # the demo model: NVFP4, the real tokenizer
    args = ["generate", "--model", "demo", "DeepSeek-V4 is", "--max-tokens", "6", "--temperature", "0", "--device",
            "cpu", "--no-progress"]
    assert cli(args) == 0
    one = capsys.readouterr().out
    assert cli(args + ["--tensor-parallel-size", "2"]) == 0
    assert capsys.readouterr().out == one and one.strip()


def test_dummy_weights_per_rank_are_slices_of_one_process_draw():
    cfg = ModelConfig.tiny()
    whole = dummy_model(cfg, "nvfp4", dtype=torch.float32, seed=3).state_dict()
    for layout in (Layout(tp=2), Layout(tp=2, ep=True), Layout(pp=2)):
        for shard in layout.shards(cfg):
            part = dummy_model(cfg, "nvfp4", dtype=torch.float32, seed=3, shard=shard).state_dict()
            for key, value in part.items():
                assert_slice_of(whole[key], value, key, shard)


def assert_slice_of(whole: torch.Tensor, part: torch.Tensor, key: str, shard) -> None:
    """`part` must be `whole` cut where the rank's shard says (its experts, its rows or columns)."""
    if whole.shape != part.shape:
        if ".ffn.experts." in key and shard.layout.ep:
            whole = whole[shard.experts.start:shard.experts.stop]
        else:
            axis = next(i for i, (a, b) in enumerate(zip(whole.shape, part.shape)) if a != b)
            t = shard.tp_rank
            whole = whole.narrow(axis, t * part.shape[axis], part.shape[axis])
    u8 = lambda t: t.view(torch.uint8) if t.dtype.itemsize == 1 else t  # noqa: E731
    assert torch.equal(u8(whole), u8(part)), key


@pytest.mark.parametrize("fmt,layout", [("bf16", Layout(tp=2)), ("bf16", Layout(tp=2, ep=True)),
                                        ("nvfp4", Layout(tp=2)), ("bf16", Layout(tp=2, pp=2))])
def test_each_rank_reads_exactly_its_slices(fmt, layout):
    path = fx.tiny(fmt)
    whole = load(path).state_dict()
    plan = layout_plan(open_checkpoint(path), layout)
    assert plan.ok, plan.problems
    for shard in layout.shards(ModelConfig.from_json(path)):
        part = load(path, shard=shard).state_dict()   # no communicator: loading only
        assert set(part) <= set(whole)
        for key, value in part.items():
            assert_slice_of(whole[key], value, key, shard)
    # a replicated tensor is read whole by both TP ranks; a split one in two halves, once each
    assert plan.reads["layers.0.attn.wkv.weight"] == {None: list(layout.stage_ranks(0))}
    assert sorted(plan.reads["layers.0.attn.wq_b.weight"].values()) == [[0], [1]]


def test_layout_plan_refuses_slices_that_cut_quantization_blocks():
    plan = layout_plan(open_checkpoint(fx.tiny("official")), Layout(tp=2))
    assert any("a mxfp4 scale stores 32 elements of axis 1 per index" in p and "enable_expert_parallel" in p
               for p in plan.problems), plan.problems
    assert any("a fp8 scale stores 128 elements" in p for p in plan.problems)
    with pytest.raises(LayoutError, match=r"stores 16 elements of axis 1 per index"):
        region("layers.0.ffn.experts.0.w2.weight_scale", (64, 2), "nvfp4", Split(1, 8, 16, 32))
    assert region("layers.0.attn.wo_a.scale", (2, 1), "fp8", Split(0, 128, 200, 200)) == (slice(1, 2),)


def test_tiling_check_finds_overlaps_and_gaps():
    problems = []
    check_tiling("t", (8, 4), [(slice(0, 4),), (slice(4, 8),)], problems)
    check_tiling("t", (8, 4), [None], problems)
    assert problems == []
    check_tiling("t", (8, 4), [(slice(0, 5),), (slice(4, 8),)], problems)
    check_tiling("t", (8, 4), [(slice(0, 4),)], problems)
    check_tiling("t", (8, 4), [None, (slice(0, 4),)], problems)
    assert len(problems) == 3 and "overlap" in problems[0] and "end at 4" in problems[1]


def test_layout_splits_layers_vocabulary_and_experts():
    cfg = ModelConfig.tiny(vocab_size=511)
    assert [Layout(pp=2).stage_layers(cfg, s) for s in range(2)] == [range(0, 3), range(3, 5)]
    assert [Layout(tp=2).vocab_rows(cfg, t) for t in range(2)] == [range(0, 256), range(256, 511)]
    shards = Layout(tp=2, pp=2, ep=True).shards(cfg)
    assert [(s.stage, s.tp_rank, s.layers, s.experts) for s in shards] == [
        (0, 0, range(0, 3), range(0, 4)), (0, 1, range(0, 3), range(4, 8)),
        (1, 0, range(3, 5), range(0, 4)), (1, 1, range(3, 5), range(4, 8))]
    last = shards[3]
    assert last.holds("head.weight") and last.holds("mtp.0.ffn.experts.7.w1.weight")
    assert not last.holds("mtp.0.ffn.experts.3.w1.weight") and not last.holds("embed.weight")
    assert last.split("layers.3.attn.wo_b.weight") == Split(1, 16, 32, 32)
    assert last.split("layers.3.attn.wkv.weight") is None and last.split("layers.3.ffn.experts.5.w2.weight") is None
    assert last.stage_config().compress_ratios == (128, 4, 0) and last.stage_config().num_hash_layers == 0


def test_step_message_round_trips():
    batch = SeqBatch((2, 0), (7, 0), (1, 3), ((4,), (0, 1)), end_bound=9)
    inputs = StepInputs(torch.tensor([5, 6, 7, 8]), batch, (0, 3), (1,), micro_batches=2)
    header, payload = inputs.encode()
    back = StepInputs.decode(header, payload)
    assert back.batch == batch and back.batch.end_bound == 9 and back.rows == (0, 3) and back.resets == (1,)
    assert torch.equal(back.ids, inputs.ids) and back.micro_batches == 2


def test_micro_batches_cut_a_step_into_parts_that_cover_each_token_once():
    batch = SeqBatch((3, 0, 5), (0, 7, 2), (5, 1, 6), ((4,), (0, 1), (2,)), end_bound=20)
    assert micro_batch_bounds(12, 3) == [(0, 4), (4, 8), (8, 12)] and micro_batch_bounds(5, 2) == [(0, 2), (2, 5)]
    for parts in range(1, 13):
        slots, positions = [], []
        for a, b in micro_batch_bounds(batch.num_tokens, parts):
            part = batch.tokens_between(a, b)
            assert part.num_tokens == b - a and part.end_bound == 20
            assert all(batch.pages[batch.slots.index(s)] == t for s, t in zip(part.slots, part.pages))
            slots += [s for s, n in zip(part.slots, part.lengths) for _ in range(n)]
            positions += part.positions().tolist()
        assert slots == [s for s, n in zip(batch.slots, batch.lengths) for _ in range(n)]
        assert positions == batch.positions().tolist()
    with pytest.raises(ValueError, match=r"token range \[4, 4\)"):
        batch.tokens_between(4, 4)


def test_pipeline_micro_batches_give_the_tokens_and_logits_of_one_process(one_process):
    """pp = 2 with the prefill step cut into 7 parts (the stages run different parts at once): the same greedy
    tokens as one process, and its logits within 1e-5 (a part's products have fewer rows)."""
    tokens, logits, generated = one_process
    with dsv4.LLM(rf.variant("wide"), **ENGINE, pipeline_parallel_size=2) as llm:
        driver = llm.engine.driver
        driver.micro_batch_tokens = 8                 # 62 prompt tokens -> 7 parts; a 3-token decode step -> 1
        parts, send = [], driver.channel.send

        def recording(inputs):
            parts.append(inputs.micro_batches if inputs is not None else None)
            send(inputs)
        driver.channel.send = recording
        got_tokens, got_logits = greedy_steps(driver.step, driver.reset)
        assert parts == [7] + [1] * (STEPS - 1)
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == generated and max(parts) == 7
    assert got_tokens == tokens
    diff = float((got_logits - logits).abs().max())
    assert diff <= 1e-5, diff


def test_inspect_plan_prints_bytes_per_rank_and_refuses_what_cannot_fit(capsys):
    path = str(fx.tiny("bf16"))
    assert cli(["inspect", path, "--plan", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
                "--device-memory", "1GiB"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if "weight bytes" in line) + 1:][:4]
    plan = layout_plan(open_checkpoint(path), Layout(tp=2, pp=2))
    assert [int(row.split()[-2].replace(",", "")) for row in table] == plan.bytes_per_rank
    assert [row.split()[:4] for row in table] == [["0", "0", "0", "0-2"], ["1", "0", "1", "0-2"],
                                                  ["2", "1", "0", "3-4"], ["3", "1", "1", "3-4"]]
    assert any("plan fits" in line for line in lines)
    # the cache tokens column: whole pages of the rank's stage beside 8 slots' state in the rest of 0.9 GiB, as the
    # pools KVCache allocates measure them (one page more would not fit)
    from dsv4.runtime.cache import PAGE_TOKENS, KVCache
    cfg = open_checkpoint(path).config
    for rank, row in enumerate(table):
        tokens = int(row.split()[-1].replace(",", ""))
        stage = Layout(tp=2, pp=2).shard(cfg, rank).stage_config()
        room = int(2**30 * 0.9) - plan.bytes_per_rank[rank]
        pool_bytes = [sum(p.nbytes for p in KVCache(stage, 8, tokens // PAGE_TOKENS + k, torch.bfloat16,
                                                      "meta").pools.values()) for k in (0, 1)]
        assert tokens > 0 and tokens % PAGE_TOKENS == 0 and pool_bytes[0] <= room < pool_bytes[1]
    assert cli(["inspect", path, "--plan", "-tp", "2", "-pp", "2", "--device-memory", "1GiB", "--kv-cache-dtype",
                "fp8"]) == 0
    fp8 = capsys.readouterr().out.splitlines()
    fp8_rows = fp8[next(i for i, line in enumerate(fp8) if "weight bytes" in line) + 1:][:2]
    assert int(fp8_rows[0].split()[-1].replace(",", "")) > int(table[0].split()[-1].replace(",", ""))
    assert cli(["inspect", path, "--plan", "-tp", "2", "--device-memory", "500KB"]) == 1
    assert "more than 0.9 of a 512,000-byte device" in capsys.readouterr().out
    assert cli(["inspect", path, "--plan", "-tp", "3"]) == 1
    assert "does not divide num_attention_heads=4" in capsys.readouterr().out


def test_graph_step_message_round_trips():
    from dsv4.runtime.graphs import GraphStep
    from dsv4.runtime.spmd import _decode_graph_step, _encode_graph_step
    step = GraphStep(4, 320, (5, 6, 7), (10, 0, 255), (2, 0, 1), ((0, (3,)), (1, (4, 7))), (3,))
    assert _decode_graph_step(*_encode_graph_step(step)) == step
    bare = GraphStep(1, 128, (9,), (1,), (0,))
    assert _decode_graph_step(*_encode_graph_step(bare)) == bare


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(tensor_parallel_size=2,
                                                                      enable_expert_parallel=True)],
                         ids=["tp2", "tp2-ep"])
def test_decode_runner_on_every_rank_gives_the_tokens_of_one_process(layout, one_process, monkeypatch):
    """The decode runner of a parallel engine (every rank replays the same padded bucket, its all-reduces meeting the
    others'), here without capture (the CPU path of what CUDA captures): LLM.generate's greedy tokens of one process,
    its decode steps sent as GRAPH messages, and a second generate reusing the slots (page tables rewritten)."""
    import dsv4.api

    _, _, generated = one_process
    monkeypatch.setattr(dsv4.api, "_decode_runner", lambda device, layout, enforce_eager: "padded")
    with dsv4.LLM(rf.variant("wide"), **ENGINE, **layout) as llm:
        driver = llm.engine.driver
        assert llm.engine.graphs is driver.graphs is not None and driver.cache.num_slots == 4
        sent, send = [], driver.channel.send
        driver.channel.send = lambda inputs: (sent.append(type(inputs).__name__), send(inputs))[1]
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == generated
        assert sent.count("GraphStep") == STEPS - 1 and sent.count("StepInputs") == 1
        again = llm.generate(PROMPTS[::-1], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == generated[::-1]
        procs = list(llm._group.procs.values())
    assert [p.exitcode for p in procs] == [0] * len(procs)


@pytest.mark.parametrize("disable", [False, True])
def test_engine_options_reach_every_ranks_spec(monkeypatch, disable):
    """disable_custom_all_reduce, kv_cache_dtype and the decode runner travel to the ranks in their RankSpec (on
    CPU: plain steps)."""
    from dsv4.runtime import workers

    class Captured(Exception):
        pass

    def start(spec):
        raise Captured(spec)
    monkeypatch.setattr(workers, "start", start)
    with pytest.raises(Captured) as got:
        dsv4.LLM(rf.variant("wide"), **ENGINE, tensor_parallel_size=2, disable_custom_all_reduce=disable,
                 kv_cache_dtype="fp8" if disable else "auto")
    spec = got.value.args[0]
    assert spec.one_shot_all_reduce is not disable and spec.decode_runner == "plain" and spec.max_model_len == 512
    assert spec.kv_cache_dtype == ("fp8" if disable else "auto")


def test_decode_runner_of_a_parallel_engine():
    """CUDA with one pipeline stage: the decode runner, captured, or uncaptured with enforce_eager (the same padded
    steps, so the same tokens); several stages or the CPU: plain steps."""
    from dsv4.api import _decode_runner
    from dsv4.parallel.layout import Layout

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert _decode_runner(cuda, Layout(tp=2), enforce_eager=False) == "graphs"
    assert _decode_runner(cuda, Layout(tp=2), enforce_eager=True) == "padded"
    assert _decode_runner(cuda, Layout(tp=2, pp=2), enforce_eager=False) == "plain"
    assert _decode_runner(cpu, Layout(tp=2), enforce_eager=False) == "plain"
