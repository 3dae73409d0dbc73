"""How the model is split over ranks: tensor parallel (TP), expert parallel (EP) and pipeline parallel (PP).

world = tp * pp ranks; rank r is TP rank `r % tp` of pipeline stage `r // tp` (a stage's TP ranks are consecutive,
so a TP group stays inside one machine when tp divides the GPUs per machine). A stage holds a contiguous range of
main layers (the first `L % pp` stages one layer more); the first stage also holds the embedding, the last the
HyperHead, final norm, head and the MTP block(s).

Within a stage (docs/parallel.md says why each tensor is split or replicated):
* attention: split by query heads. wq_b rows (heads), attn_sink (heads), wo_a rows (its o_groups, each a run of
  consecutive heads) and wo_b columns: each rank attends with H / tp heads and produces a partial wo_b output.
  wq_a, q_norm, wkv, kv_norm, the compressor and the indexer are replicated: the shared K=V row, the compressed
  entries and the indexer's picks are computed identically on every rank, so every rank's cache holds the same;
* MoE: every expert split along its intermediate dimension (w1 / w3 rows, w2 columns), or with `ep` the routed
  experts partitioned (rank t holds experts [t E / tp, (t + 1) E / tp) whole); the shared expert is split along its
  intermediate dimension either way, the router is replicated;
* embedding and head: split by vocabulary rows (`vocab_rows`: ceil(V / tp) rows a rank, the last may hold fewer);
* norms, mHC parameters and the 4 residual streams are replicated.
The partial outputs of attention and of the MoE are summed by one all-reduce each (`Communicator.all_reduce`), the
embedding's by one all-reduce, the head's logits gathered by one all-gather.

`Shard.split(name)` gives the part of each canonical tensor (`checkpoint.spec` names) a rank holds, as an element
range of one logical axis (a linear's [out, in]); the checkpoint layer turns it into byte ranges of each stored leaf.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig


class LayoutError(ValueError):
    """A parallel layout that cannot hold this model (a count that does not divide, a slice off a block)."""


@dataclass(frozen=True)
class Split:
    """Elements [start, stop) of axis `axis` (0 = rows / out features, 1 = in features) of a canonical tensor whose
    axis has `size` elements."""

    axis: int
    start: int
    stop: int
    size: int


def even_part(n: int, parts: int, index: int) -> tuple[int, int, int]:
    """(start, stop, n) of part `index` of n split into `parts` equal parts (n must divide)."""
    size = n // parts
    return index * size, (index + 1) * size, n


@dataclass(frozen=True)
class Layout:
    tp: int = 1          # tensor_parallel_size: ranks of one pipeline stage
    pp: int = 1          # pipeline_parallel_size: stages
    ep: bool = False     # enable_expert_parallel: routed experts partitioned over a stage's TP ranks

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def parallel(self) -> bool:
        return self.world_size > 1

    def describe(self) -> str:
        return f"tensor_parallel_size={self.tp}, pipeline_parallel_size={self.pp}" + \
            (", enable_expert_parallel" if self.ep else "")

    def check(self, cfg: ModelConfig) -> None:
        """Refuse (LayoutError naming the numbers) a layout this model cannot be split into."""
        if self.tp < 1 or self.pp < 1:
            raise LayoutError(f"{self.describe()}: sizes must be >= 1")
        need = [("num_attention_heads", cfg.num_attention_heads, "attention is split by query heads"),
                ("o_groups", cfg.o_groups, "wo_a is split by output groups"),
                ("moe_intermediate_size", cfg.moe_intermediate_size,
                 "the shared expert" + ("" if self.ep else " and every routed expert") + " is split along it")]
        if self.ep:
            need.append(("n_routed_experts", cfg.n_routed_experts, "expert parallel partitions the routed experts"))
        for key, value, why in need:
            if value % self.tp:
                raise LayoutError(f"tensor_parallel_size={self.tp} does not divide {key}={value} ({why}); use a "
                                  f"tensor_parallel_size that divides {value}")
        if self.pp > cfg.num_hidden_layers:
            raise LayoutError(f"pipeline_parallel_size={self.pp} exceeds num_hidden_layers={cfg.num_hidden_layers} "
                              "(every stage holds at least one layer)")

    def stage_ranks(self, stage: int) -> range:
        return range(stage * self.tp, (stage + 1) * self.tp)

    def stage_layers(self, cfg: ModelConfig, stage: int) -> range:
        """Contiguous main layers of `stage`: the first L % pp stages hold one layer more."""
        base, extra = divmod(cfg.num_hidden_layers, self.pp)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (stage < extra))

    def vocab_rows(self, cfg: ModelConfig, tp_rank: int) -> range:
        """Embedding / head rows of TP rank `tp_rank`: ceil(V / tp) a rank, the last ones may hold fewer."""
        chunk = -(-cfg.vocab_size // self.tp)
        return range(min(cfg.vocab_size, tp_rank * chunk), min(cfg.vocab_size, (tp_rank + 1) * chunk))

    def shard(self, cfg: ModelConfig, rank: int) -> Shard:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside a world of {self.world_size} ({self.describe()})")
        stage, t = divmod(rank, self.tp)
        experts = range(cfg.n_routed_experts)
        if self.ep:
            experts = range(*even_part(cfg.n_routed_experts, self.tp, t)[:2])
        return Shard(self, cfg, rank, self.stage_layers(cfg, stage), self.vocab_rows(cfg, t), experts)

    def shards(self, cfg: ModelConfig) -> list[Shard]:
        return [self.shard(cfg, r) for r in range(self.world_size)]


@dataclass(frozen=True)
class Shard:
    """What one rank holds of the model of `cfg` under `layout`."""

    layout: Layout
    cfg: ModelConfig
    rank: int
    layers: range            # main layers of this rank's stage
    vocab: range             # embedding / head rows
    experts: range           # routed experts held (all of them unless expert parallel)

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.layout.tp

    @property
    def stage(self) -> int:
        return self.rank // self.layout.tp

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.layout.pp - 1

    def attention_config(self) -> ModelConfig:
        """The config one rank's attention modules are built from: H / tp query heads in o_groups / tp groups
        (every other field, the shared K=V row, compressor and indexer included, as the model's)."""
        if self.tp == 1:
            return self.cfg
        return self.cfg.replace(num_attention_heads=self.cfg.num_attention_heads // self.tp,
                                o_groups=self.cfg.o_groups // self.tp)

    @property
    def routed_intermediate(self) -> int:
        """Intermediate size of each routed expert held: whole with expert parallel, else 1 / tp of it."""
        return self.cfg.moe_intermediate_size // (1 if self.layout.ep else self.tp)

    @property
    def shared_intermediate(self) -> int:
        return self.cfg.moe_intermediate_size // self.tp

    def stage_config(self) -> ModelConfig:
        """The model cut to this stage's layers, renumbered from 0 (what the stage's decode cache is sized from)."""
        cfg, (a, b) = self.cfg, (self.layers.start, self.layers.stop)
        if (a, b) == (0, cfg.num_hidden_layers):
            return cfg
        ratios = cfg.compress_ratios[a:b] + cfg.compress_ratios[cfg.num_hidden_layers:]
        return cfg.replace(num_hidden_layers=b - a, compress_ratios=ratios,
                           num_hash_layers=max(0, min(cfg.num_hash_layers, b) - a))

    def holds(self, name: str) -> bool:
        """Whether this rank holds any of canonical tensor (or module path) `name`."""
        parts = name.split(".")
        if parts[0] == "embed":
            return self.first_stage
        if parts[0] == "layers" and int(parts[1]) not in self.layers:
            return False
        if parts[0] != "layers" and not self.last_stage:      # head, norm, hc_head_*, mtp.*
            return False
        if len(parts) > 4 and parts[2:4] == ["ffn", "experts"] and parts[4].isdigit():
            return int(parts[4]) in self.experts
        return True

    def split(self, name: str) -> Split | None:
        """The part of held canonical tensor `name` (a linear by its module path or any of its leaves) this rank
        holds; None: all of it (replicated, or a whole expert under expert parallel)."""
        parts = name.split(".")
        if parts[-1] in ("weight", "scale", "weight_scale", "weight_scale_2", "input_scale") and len(parts) > 1:
            parts = parts[:-1]
        if parts[0] in ("embed", "head"):
            return Split(0, self.vocab.start, self.vocab.stop, self.cfg.vocab_size) if self.tp > 1 else None
        if self.tp == 1 or parts[0] not in ("layers", "mtp"):
            return None
        cfg, local = self.cfg, ".".join(parts[2:])
        heads = cfg.num_attention_heads * cfg.head_dim
        groups = cfg.o_groups * cfg.o_lora_rank
        I = cfg.moe_intermediate_size
        if local == "attn.wq_b":
            return Split(0, *even_part(heads, self.tp, self.tp_rank))
        if local == "attn.attn_sink":
            return Split(0, *even_part(cfg.num_attention_heads, self.tp, self.tp_rank))
        if local == "attn.wo_a":
            return Split(0, *even_part(groups, self.tp, self.tp_rank))
        if local == "attn.wo_b":
            return Split(1, *even_part(groups, self.tp, self.tp_rank))
        expert = parts[2:4] == ["ffn", "experts"]
        if (expert and not self.layout.ep) or parts[2:4] == ["ffn", "shared_experts"]:
            axis = 1 if parts[-1] == "w2" else 0
            return Split(axis, *even_part(I, self.tp, self.tp_rank))
        return None
