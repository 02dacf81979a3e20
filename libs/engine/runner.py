"""The torch side of a step: owns the KV tensors of both device pools and the host tier, turns a
BatchPlan into model inputs (flattened token ids + BatchMeta), runs the forward and samples.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import accumulate
from typing import NamedTuple

import torch

from libs.engine import mm as mm_rows
from libs.engine.gcache_tier import StagedValues, write_host_blocks
from libs.engine.host_tier import CopyWorker, LayerwiseLoad, LoadMode, copy_pages, layer_slots, plan_copies
from libs.engine.plan import BatchPlan
from libs.engine.request import SamplingParams
from libs.engine.sampling import DRAW_TOKEN, History, SampleResult, TokenMask, draw_seed, make_generator, sample
from libs.kvcache import ArenaPlan
from libs.model.paged import BatchMeta, KVPools


@dataclass(frozen=True)
class PoolSizes:
    page_size: int
    num_full_pages: int
    num_swa_pages: int
    num_host_full_pages: int = 0
    num_host_swa_pages: int = 0
    arena: ArenaPlan | None = None  # one device arena instead of the two device pools (EngineConfig.kv_arena)
    host_arena: ArenaPlan | None = None  # one host arena instead of the two host pools (with a device arena)
    # a parallel rank's arenas: the whole model's layer-pages per plane slot ({"full": r, "swa": r}, rank 0's
    # cache lays pages out by them) kept over the rank's own KV heads (KVArena.stride); None: the config's own
    arena_sub: dict[str, int] | None = None


def build_inputs(plan: BatchPlan, device: torch.device | str,
                 kv: KVPools | None = None) -> tuple[torch.Tensor, BatchMeta]:
    """Flatten the plan's tokens and build the attention metadata (page tables padded with -1; with an arena
    `kv`, also the per-chunk physical tables, translated once per step on the CPU).

    Everything goes through flat Python lists and one torch.tensor() per tensor: per-sequence tensor
    building (or nested lists) costs more than the decode forward's attention on small models."""
    seqs = plan.seqs
    ids: list[int] = []
    for s in seqs:
        ids += s.token_ids
    width = max(max(len(s.full_pages), len(s.swa_pages)) for s in seqs)
    full: list[int] = []
    swa: list[int] = []
    for s in seqs:
        full += s.full_pages
        full += _PAD * (width - len(s.full_pages))
        swa += s.swa_pages
        swa += _PAD * (width - len(s.swa_pages))
    q_lens = [s.num_new for s in seqs]
    # one logits row per sampling sequence; a verify step (num_draft > 0) also has one per draft
    logits_rows = [r for end, s in zip(accumulate(q_lens), seqs, strict=True) if s.sample
                   for r in range(end - 1 - s.num_draft, end)]
    cpu_pages = torch.tensor([full, swa], dtype=torch.int64).view(2, len(seqs), width)
    rows = kv.batch_rows(cpu_pages[0], cpu_pages[1], device) if kv is not None else (None, None)
    pages = cpu_pages.to(device)
    rebuild = any(s.full_from for s in seqs)
    meta = BatchMeta(
        q_lens=q_lens, kv_lens=[s.start + s.num_new for s in seqs], full_page_table=pages[0],
        swa_page_table=pages[1], logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=device),
        full_write_from=[s.full_from for s in seqs] if rebuild else None,
        swa_kv_start=[s.swa_from for s in seqs] if rebuild else None, full_rows=rows[0], swa_rows=rows[1])
    return torch.tensor(ids, dtype=torch.int64, device=device), meta


_PAD = [-1]


class ModelInputs(NamedTuple):
    """One forward's model inputs: flattened token ids, the attention metadata, the image embedding rows."""

    input_ids: torch.Tensor
    meta: BatchMeta
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None


class StepInterrupted(Exception):
    """Raised between decoder layers when a step's interrupt check fires (see EngineCore.step)."""


class ModelRunner:
    """Runs the model over a BatchPlan. The KV pools live here; the cache only hands out page ids."""

    def __init__(self, model: torch.nn.Module | None, model_config, sizes: PoolSizes, *,
                 dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
                 load_mode: LoadMode | str = LoadMode.THREAD, draft_layers: int = 0) -> None:
        self.load_mode = LoadMode(load_mode)
        self.model = model
        self.model_config = model_config
        self.device = torch.device(device)
        # MTP draft blocks are SWA blocks: their KV is extra layers of the SWA pool (same pages, same copies)
        self.draft_layers = draft_layers
        n_swa = len(model_config.swa_layers) + draft_layers
        if sizes.arena is not None:
            self.kv = KVPools.allocate_arena(model_config, sizes.arena.units, sizes.arena.planes, sizes.page_size,
                                             dtype, self.device, n_swa_layers=n_swa,
                                             unit_bytes=sizes.arena.unit_bytes, sub=sizes.arena_sub)
        else:
            self.kv = KVPools.allocate(model_config, sizes.num_full_pages, sizes.num_swa_pages,
                                       sizes.page_size, dtype, self.device, n_swa_layers=n_swa)
        self.host = None
        if sizes.host_arena is not None:  # one host arena: unit-addressed like the device one (its tables bound later)
            self.host = KVPools.allocate_arena(model_config, sizes.host_arena.units, sizes.host_arena.planes,
                                               sizes.page_size, dtype, "cpu", n_swa_layers=n_swa,
                                               unit_bytes=sizes.host_arena.unit_bytes, sub=sizes.arena_sub)
            if self.device.type == "cuda":  # pinned host memory makes h2d copies asynchronous
                a = self.host.arena
                assert a is not None
                a.k, a.v = a.k.pin_memory(), a.v.pin_memory()
        elif sizes.num_host_full_pages or sizes.num_host_swa_pages:
            self.host = KVPools.allocate(model_config, max(sizes.num_host_full_pages, 1),
                                         max(sizes.num_host_swa_pages, 1), sizes.page_size, dtype, "cpu",
                                         n_swa_layers=n_swa)
            if self.device.type == "cuda":  # pinned host memory makes h2d copies asynchronous
                for name in ("full_k", "full_v", "swa_k", "swa_v"):
                    setattr(self.host, name, getattr(self.host, name).pin_memory())
        # the draft layers' slots come last: a layer-wise load finishes them after the decoder layers
        self.slots = layer_slots((*model_config.layer_is_swa, *([True] * draft_layers)))
        self.hidden: torch.Tensor | None = None  # final-norm hidden of the last forward's tokens (drafting only)
        self._load: LayerwiseLoad | None = None
        # The hooks live on the (possibly shared) model: they hold the runner weakly and are removed when the
        # runner is closed or collected, so engines built over one model neither pile up hooks nor stay alive.
        ref = weakref.ref(self)
        self._copy_workers: list[CopyWorker] = []  # at most one, started on the first threaded load
        hooks = []
        for i, layer in enumerate(decoder_layers(model) if model is not None else ()):  # (None: libs/engine/mock.py)
            hooks.append(layer.register_forward_pre_hook(
                _own_forward_hook(ref, partial(ModelRunner._before_layer, layer=i))))
            # a second interrupt poll inside each layer, before its MLP/MoE: halves how long an arrival waits
            mlp = getattr(layer, "mlp", None)
            if isinstance(mlp, torch.nn.Module):
                hooks.append(mlp.register_forward_pre_hook(
                    _own_forward_hook(ref, partial(ModelRunner._poll, where=f"the MLP of layer {i}"))))
        self._finalizer = weakref.finalize(self, _release, hooks, self._copy_workers)
        self._interrupt: Callable[[], bool] | None = None
        self._forward_thread: int | None = None  # the thread inside forward(): the layer hooks act for it only
        self._generators: dict[str, torch.Generator] = {}
        self._default_gen = make_generator(seed)
        # pseudo tokens (images) are looked up as the pad id; their rows are then overwritten
        self._pad_id = int(getattr(model_config, "image_token_id", None) or 0)

    def close(self) -> None:
        """Remove the layer hooks from the model and stop the copy thread (idempotent; also done on GC)."""
        self._finalizer()

    # ------------------------------------------------------------------ tiers
    def _before_layer(self, layer: int) -> None:
        self._poll(f"layer {layer}")
        if self._load is not None:
            self._load.wait_layer(layer)

    def _poll(self, where: str) -> None:
        if self._interrupt is not None and self._interrupt():
            raise StepInterrupted(f"step interrupted before {where}")

    def backup(self, copies: Sequence) -> None:
        """Device -> host, synchronous: the device pages may be reused right after."""
        if not copies:
            return
        if self.host is None:
            raise RuntimeError("the cache asked for a host backup but the engine has no host tier")
        for group, (src, dst, src_units, dst_units) in plan_copies(copies, "d2h", self.kv, self.host).items():
            copy_pages(self.kv, self.host, group, src, dst, src_units=src_units, dst_units=dst_units)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def start_load(self, copies: Sequence) -> None:
        if copies:
            if self.host is None:
                raise RuntimeError("the cache returned host load-backs but the engine has no host tier")
            if self.load_mode is LoadMode.THREAD and not self._copy_workers:
                self._copy_workers.append(CopyWorker(self.device.type == "cuda"))
            worker = self._copy_workers[0] if self._copy_workers else None
            self._load = LayerwiseLoad(self.host, self.kv, self.slots, copies, self.load_mode, worker)

    def finish_load(self) -> None:
        load, self._load = self._load, None
        if load is not None:
            load.finish()

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, plan: BatchPlan, interrupt: Callable[[], bool] | None = None,
                mm: mm_rows.Lookup | None = None) -> torch.Tensor:
        """Execute the plan's copies and forward; logits [num sampling seqs, vocab] in plan order.

        With `interrupt`, it is polled before every decoder layer and before each layer's MLP, and the
        forward raises StepInterrupted as soon as it returns True. The copies still complete (the cache's
        books already moved those pages); the K/V the forward wrote so far sits at positions no sequence
        has committed, so it is simply written again when the chunk is rescheduled.

        `mm` (request id -> its MMEmbeddings or None): chunks over image positions look the pad id up and get
        their rows overwritten by the request's embedding rows (libs/engine/mm.py)."""
        return self.execute(plan.backup_copies, plan.load_copies, self.inputs(plan, mm), interrupt)

    def inputs(self, plan: BatchPlan, mm: mm_rows.Lookup | None = None) -> ModelInputs | None:
        """The model inputs of the plan's forward (None when it has no sequences: copies only)."""
        if not plan.seqs:
            return None
        input_ids, meta = build_inputs(plan, self.device, self.kv if self.kv.arena is not None else None)
        embeds = None
        if mm is not None and self.model_config.vision is not None:
            input_ids, embeds = mm_rows.model_inputs(input_ids, plan.seqs, mm, self._pad_id)
        return ModelInputs(input_ids, meta, embeds)

    @torch.inference_mode()
    def execute(self, backup_copies: Sequence, load_copies: Sequence, inputs: ModelInputs | None,
                interrupt: Callable[[], bool] | None = None) -> torch.Tensor:
        """The copies (backups first), then the forward over `inputs` (see forward)."""
        self.backup(backup_copies)
        self.start_load(load_copies)
        self._interrupt = interrupt
        self._forward_thread = threading.get_ident()
        try:
            if inputs is None:
                return torch.empty(0)
            assert self.model is not None  # (a model-less runner, libs/engine/mock.py, has its own forward)
            # the compiled decode graph runs no layer hooks: not while a load or an interrupt must act between layers
            graph = {"graph": False} if self._load is not None or interrupt is not None else {}
            if not self.draft_layers:
                return self.model(inputs.input_ids, inputs.meta, self.kv, embeds=inputs.embeds, **graph)
            logits, self.hidden = self.model(inputs.input_ids, inputs.meta, self.kv, return_hidden=True,
                                             embeds=inputs.embeds, **graph)
            return logits
        finally:
            self._interrupt = self._forward_thread = None
            self.finish_load()

    def check_alive(self) -> None:
        """Raise when part of the runner is gone (a parallel runner's rank process); a no-op here."""

    # ------------------------------------------------------------------ GCache (L3) values
    def l3_gather(self, group: str, pages: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A pool group's device pages, page-major, every KV head: what the L3 write-back copies out."""
        return self.kv.gather_pages(group, list(pages))

    def write_host_blocks(self, full_ids: Sequence[int], swa_ids: Sequence[int], staged: StagedValues,
                          skip: int = 0) -> None:
        """An L3 import into the host tier (libs/engine/gcache_tier.write_host_blocks)."""
        write_host_blocks(self.host, full_ids, swa_ids, staged, skip)

    def kv_access(self):
        """How the KV hand-off reads and writes this runner's KV (a `libs.engine.disagg.KVAccess`): its own pools,
        in place. (Imported here: libs.engine.disagg imports the core, which imports this module.)"""
        from libs.engine.disagg.shipment import KVAccess

        return KVAccess(self.kv)

    def sample(self, logits: torch.Tensor, req_ids: list[str], params: list[SamplingParams], positions: list[int],
               histories: list[History | None] | None = None, mask: TokenMask | None = None) -> SampleResult:
        """One token per row; `positions`: the index each row's token will have (prompt + output)."""
        # greedy rows never draw: they share the default generator instead of a per-request lookup
        gens = [self._default_gen if p.greedy else self.generator(r, p, pos)
                for r, p, pos in zip(req_ids, params, positions, strict=True)]
        return sample(logits, params, gens, histories, mask)

    def generator(self, req_id: str, params: SamplingParams, position: int, salt: int = DRAW_TOKEN
                  ) -> torch.Generator:
        """The generator a sampled request draws from for its token at `position`: the shared one when unseeded;
        when seeded its own, seeded for this draw (`draw_seed`)."""
        if params.seed is None:
            return self._default_gen
        gen = self._generators.get(req_id)
        if gen is None:
            gen = self._generators[req_id] = torch.Generator(device="cpu")
        gen.manual_seed(draw_seed(params.seed, position, salt))
        return gen

    def forget(self, req_id: str) -> None:
        """Drop per-request state (its generator) once the request is finished."""
        self._generators.pop(req_id, None)


def _own_forward_hook(ref: weakref.ReferenceType, act: Callable[[ModelRunner], None]):
    """A forward pre-hook that runs act(runner) only inside the runner's own forward: not for someone else's
    forward of the same model (another engine, a reference run in a test), nor once the runner is gone."""
    def hook(_module, _args):
        runner = ref()
        if runner is not None and threading.get_ident() == runner._forward_thread:
            act(runner)
    return hook


def _release(hooks: list, workers: list[CopyWorker]) -> None:
    for h in hooks:
        h.remove()
    for w in workers:
        w.close()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers in order (the layer-wise load hooks attach here)."""
    for path in ("layers", "model.layers", "decoder.layers"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        if isinstance(obj, torch.nn.ModuleList):
            return list(obj)
    raise AttributeError(f"cannot find the decoder layers of {type(model).__name__} (tried .layers, .model.layers)")


@torch.inference_mode()
def one_shot_logits(model: torch.nn.Module, model_config, tokens: Sequence[int], page_size: int = 16,
                    device: str | torch.device = "cpu") -> torch.Tensor:
    """Logits of the last token from one forward over the whole sequence in fresh pools (no reuse)."""
    pages = -(-len(tokens) // page_size)
    dtype = next(model.parameters()).dtype
    kv = KVPools.allocate(model_config, pages, pages, page_size, dtype, device)
    table = torch.arange(pages, dtype=torch.int64, device=device).unsqueeze(0)
    meta = BatchMeta([len(tokens)], [len(tokens)], table, table.clone())
    return model(torch.tensor(list(tokens), dtype=torch.int64, device=device), meta, kv)[-1]


def direct_greedy(model: torch.nn.Module, model_config, prompt: Sequence[int], max_new_tokens: int,
                  page_size: int = 16) -> list[int]:
    """Reference decoding with no KV reuse at all: every token recomputes the whole sequence in
    one fresh forward over freshly allocated pools. Slow; for tests and benchmarks only."""
    tokens = list(prompt)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = one_shot_logits(model, model_config, tokens, page_size)
        out.append(int(logits.argmax()))
        tokens.append(out[-1])
    return out
