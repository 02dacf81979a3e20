"""MiMo-V2 decoder over paged KV (see ``libs/model/paged.py`` for the interface)."""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kernels import fused, plan_paged_attention
from kernels.attn_plan import AttnPlan
from kernels.kv import new_token_index
from libs.model.compiled import CompiledStep
from libs.model.config import ModelConfig
from libs.model.layers import (
    MLP,
    AttnContext,
    DecoderLayer,
    MoE,
    MTPLayer,
    RMSNorm,
    rope_cos_sin,
    rope_inv_freq,
    signed_sin,
)
from libs.model.paged import BatchMeta, KVPools


class MTP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MTPLayer(cfg) for _ in range(cfg.num_mtp_layers)])


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mtp = MTP(cfg) if cfg.num_mtp_layers else None


class RopeTable:
    """cos/sin of every position up to a high-water mark, grown by doubling: a step looks its
    positions up with one index_select instead of recomputing the trigonometry."""

    def __init__(self) -> None:
        self._cos = self._sin = torch.empty(0)
        self._key: tuple | None = None

    def lookup(self, positions: torch.Tensor, max_pos: int, inv_freq: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # keyed on the buffer itself too: loading or .to() replaces the model's inv_freq tensors
        key = (positions.device, dtype, inv_freq.device, inv_freq.data_ptr())
        if self._key != key or max_pos >= self._cos.shape[0]:
            size = max(256, 1 << max_pos.bit_length())
            all_pos = torch.arange(size, device=positions.device)
            cos, sin = rope_cos_sin(all_pos, inv_freq.to(positions.device), dtype)
            self._cos, self._sin = cos[:, None], signed_sin(sin)[:, None]  # [P, 1, rot]: broadcast over heads
            self._key = key
        return self._cos.index_select(0, positions), self._sin.index_select(0, positions)


def _context(meta: BatchMeta, table: torch.Tensor, page_size: int, window_left: int, positions: torch.Tensor,
             rope: RopeTable, inv_freq: torch.Tensor, dtype: torch.dtype, swa: bool) -> AttnContext:
    return _contexts_of(meta, table, None, page_size, window_left, positions, rope, inv_freq, dtype, swa)[0]


def _contexts_of(meta: BatchMeta, table: torch.Tensor, rows: torch.Tensor | None, page_size: int, window_left: int,
                 positions: torch.Tensor, rope: RopeTable, inv_freq: torch.Tensor, dtype: torch.dtype,
                 swa: bool) -> list[AttnContext]:
    """The attention contexts of one layer group: one for the page table, or with an arena one per table row
    of `rows` ([table rows, B, W], the physical rows of `table`'s pages). The plan is built once, over the
    table's entry indices (`_entry_table`), and each row's plan maps its slots through that row's entries
    (`_remap`): the rows share every mask and block shape, only the slots differ."""
    cos, sin = rope.lookup(positions, max(meta.kv_lens), inv_freq, dtype)
    plan = plan_paged_attention(table if rows is None else _entry_table(table), meta.q_lens, meta.kv_lens, page_size,
                                window_left, meta.swa_kv_start if swa else None)
    plans = [plan] if rows is None else _remap(plan, rows, page_size)
    if swa or meta.full_write_from is None:
        return [AttnContext(cos, sin, p, p.write_slots) for p in plans]
    # window rebuild: the full-attention K/V of the span is cached (and exact); only later positions are written
    seq, _ = new_token_index(meta.q_lens, meta.kv_lens, positions.device)
    floor = torch.as_tensor(meta.full_write_from, dtype=torch.int64, device=positions.device)
    write = torch.nonzero(positions >= floor[seq]).flatten()
    return [AttnContext(cos, sin, p, p.write_slots.index_select(0, write), write) for p in plans]


def _entry_table(table: torch.Tensor) -> torch.Tensor:
    """A page table of the same shape and -1 pattern whose entries are their own flat index b x W + j: a plan
    built on it names, for every slot it reads or writes, the table entry (slot // page) and the offset."""
    return torch.arange(table.numel(), device=table.device).view_as(table).masked_fill(table < 0, -1)


def _remap(plan: AttnPlan, rows: torch.Tensor, page_size: int) -> list[AttnPlan]:
    """One plan per table row of `rows` ([R, B, W]) from a plan over `_entry_table`: slot e x page + o becomes
    rows[t].flat[e] x page + o (the same positions, read from that row's pages). All rows and all of the
    plan's slot tensors at once: slot s moves by delta[t, s // page], delta = (rows.flat - e) x page. (Per
    row only Python objects are made: this runs once per layer group and step, a dozen torch calls.)"""
    flat = rows.flatten(1)
    r = flat.shape[0]
    delta = (flat - torch.arange(flat.shape[1], device=flat.device)) * page_size
    parts = [plan.write_slots, *(b.slots for b in plan.blocks)]
    s = torch.cat([p.flatten() for p in parts])
    moved = s + delta[:, torch.div(s, page_size, rounding_mode="floor")]  # [R, all slots]
    per_row = [m.view(r, *p.shape).unbind(0) for m, p in zip(moved.split([p.numel() for p in parts], dim=1), parts,
                                                                 strict=True)]
    tables = rows.unbind(0)
    return [_with(plan, page_table=tables[t], write_slots=per_row[0][t],
                  blocks=tuple(_with(b, slots=x[t]) for b, x in zip(plan.blocks, per_row[1:], strict=True)))
            for t in range(r)]


def _with(obj, **changes):
    """`dataclasses.replace` of a frozen dataclass without its __init__ (the fields are already valid; this
    runs per layer chunk and step)."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__, **changes)
    return new


class MiMoV2Model(nn.Module):
    """MiMo-V2 causal LM. State-dict names match the checkpoint (``model.layers.N...``, ``lm_head.weight``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.inv_freq_full: torch.Tensor
        self.inv_freq_swa: torch.Tensor
        self.register_buffer("inv_freq_full", rope_inv_freq(cfg.rotary_dim, cfg.rope_theta_full), persistent=False)
        self.register_buffer("inv_freq_swa", rope_inv_freq(cfg.rotary_dim, cfg.rope_theta_swa), persistent=False)
        self._rope_full, self._rope_swa = RopeTable(), RopeTable()
        self._compiled: CompiledStep | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def compiled(self) -> CompiledStep | None:
        return self._compiled

    def set_compiled(self, step: CompiledStep | None) -> None:
        """Run the layers' dense segments through `step` (libs/model/compiled.py); None = eager."""
        self._compiled = step
        for module in self.modules():
            if hasattr(module, "compiled") and module is not self:
                setattr(module, "compiled", step)  # noqa: B010 (an nn.Module attribute, typed per class)

    def _contexts(self, meta: BatchMeta, kv: KVPools) -> tuple[list[AttnContext], list[AttnContext]]:
        """One attention plan (and rope lookup) per layer group per forward, shared by its layers; with one
        arena one per table row of the group (a chunk of layers, BatchMeta.full_rows / swa_rows)."""
        pos = meta.positions
        full: list[AttnContext] = []
        swa: list[AttnContext] = []
        if self.cfg.full_layers:
            full = _contexts_of(meta, meta.full_page_table, meta.full_rows, kv.page_size, -1, pos, self._rope_full,
                                self.inv_freq_full, self.dtype, swa=False)
        if self.cfg.swa_layers:
            rows = meta.swa_rows[:_rows_used(kv, len(self.cfg.swa_layers))] if meta.swa_rows is not None else None
            swa = _contexts_of(meta, meta.swa_page_table, rows, kv.page_size, self.cfg.window_left, pos,
                               self._rope_swa, self.inv_freq_swa, self.dtype, swa=True)
        return full, swa

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: BatchMeta, kv: KVPools, return_hidden: bool = False,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None, graph: bool = True):
        """input_ids int64 ``[sum(q_lens)]``. Writes the new K/V into the pools, attends cached + new
        (causal; window + sinks on SWA layers) and returns float32 logits ``[num_logits, vocab]`` — plus the
        final-norm hidden states of every new token ``[T, hidden]`` when ``return_hidden`` (MTP input).
        ``embeds`` = (rows int64 ``[n]``, values ``[n, hidden]``): those rows of the token embeddings are replaced
        by the values (image / video embeddings at their pad positions, #16).

        With a compiled step (`set_compiled`) a pure decode step (one new token per sequence, no embeddings, no
        window rebuild) runs as one compiled graph (`_decode_graph`) unless `graph` is False (the runner passes
        False while it must act between layers: a layer-wise KV load, an interrupt check); the module hooks of
        the layers do not fire inside it. Other steps compile the layers' dense segments only."""
        if input_ids.shape[0] != meta.num_tokens:
            raise ValueError(f"input_ids has {input_ids.shape[0]} tokens but q_lens sum to {meta.num_tokens}")
        step = self._compiled
        if (graph and step is not None and embeds is None and meta.full_write_from is None
                and meta.num_tokens == len(meta.q_lens)):
            got = self._decode_graph(step, input_ids, meta, kv)
            if got is not None:
                return got if return_hidden else got[0]
        full, swa = self._contexts(meta, kv)
        h = self.model.embed_tokens(input_ids)
        if embeds is not None:
            h = h.index_copy(0, embeds[0], embeds[1].to(h.dtype))
        for module in self.model.layers:
            layer = cast(DecoderLayer, module)
            group, ctx = ("swa", swa) if layer.is_swa else ("full", full)
            k, v, row = kv.layer_kv(group, layer.pool_index)
            h = layer(h, ctx[row], k, v)
        h = self.model.norm(h)
        logits = self.lm_head(h.index_select(0, meta.logits_rows())).float()
        return (logits, h) if return_hidden else logits

    def _decode_graph(self, step: CompiledStep, input_ids: torch.Tensor, meta: BatchMeta,
                      kv: KVPools) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(logits, final-norm hidden) of a pure decode step through `step.decode`; None when it ran eager. No
        attention plan is built: the graph derives each sequence's key slots from its page table row and length
        (`_decode_keys`); the pages those keys need are checked mapped here, as the plan would."""
        dev = input_ids.device
        kv_lens = torch.as_tensor(meta.kv_lens, dtype=torch.int64, device=dev)
        longest = max(meta.kv_lens)
        groups = {"full": (meta.full_page_table, meta.full_rows, -1, self._rope_full, self.inv_freq_full),
                  "swa": (meta.swa_page_table, meta.swa_rows, self.cfg.window_left, self._rope_swa,
                          self.inv_freq_swa)}
        shared: dict[str, tuple] = {}  # group -> (cos, sin, key columns)
        ctxs: list[tuple] = []
        ctx_index: dict[tuple[str, int], int] = {}
        bufs: list[torch.Tensor] = []
        layers: list[tuple] = []
        weights: list[tuple] = []
        for module in self.model.layers:
            layer = cast(DecoderLayer, module)
            group = "swa" if layer.is_swa else "full"
            k_buf, v_buf, plane, row = kv.layer_base(group, layer.pool_index)
            if group not in shared:  # once per group: an arena's rows are -1 where its page table is
                table, rows, window_left, rope, inv_freq = groups[group]
                _check_decode_pages(table, meta.kv_lens, kv.page_size, window_left)
                keys = longest if window_left < 0 else min(longest, window_left + 1)
                # at least 2 keys and 2 table columns (the extra ones are masked or never read): a size of 1
                # would get a graph of its own, compiled mid-serving the first time a short sequence comes
                shared[group] = (*rope.lookup(kv_lens - 1, longest, inv_freq, self.dtype),
                                 torch.arange(max(keys, 2), device=dev))
            if (group, row) not in ctx_index:
                table, rows = groups[group][:2]
                table = table if rows is None else rows[row]
                if table.shape[1] < 2:
                    table = F.pad(table, (0, 2 - table.shape[1]), value=-1)
                cos, sin, kcol = shared[group]
                ctx_index[group, row] = len(ctxs)
                ctxs.append((cos, sin, table, kcol))
            for buf in (k_buf, v_buf):
                if not any(buf is b for b in bufs):
                    bufs.append(buf)
            attn = layer.self_attn
            window_left = self.cfg.window_left if layer.is_swa else -1
            layers.append((ctx_index[group, row], next(i for i, b in enumerate(bufs) if b is k_buf),
                           next(i for i, b in enumerate(bufs) if b is v_buf), plane, window_left, attn.num_heads,
                           attn.num_kv_heads, attn.qk_dim, attn.v_scale, attn.scale, isinstance(layer.mlp, MoE)))
            weights.append((layer.input_layernorm.weight, attn._qkv.get((attn.q_proj.weight, attn.k_proj.weight,
                                                                          attn.v_proj.weight)),
                            attn.attention_sink_bias, attn.o_proj.weight, layer.post_attention_layernorm.weight,
                            *_mlp_weights(layer.mlp)))
        c = self.cfg
        consts = (tuple(layers), kv.page_size, c.rms_norm_eps, c.num_experts_per_tok, c.n_group, c.topk_group,
                  c.norm_topk_prob, c.routed_scaling_factor)
        return step.decode(_decode_step, input_ids, kv_lens, ctxs, meta.logits_rows(), bufs, weights,
                           (self.model.embed_tokens.weight, self.model.norm.weight, self.lm_head.weight), consts)

    def mtp_contexts(self, meta: BatchMeta, kv_mtp: KVPools, steps: range) -> dict[int, AttnContext]:
        """The attention contexts of MTP blocks `steps` over one `meta`, by page-table row (`forward_mtp`'s
        `contexts`): one plan and rope lookup for all of them; with an arena, where each block's KV layer sits
        in its own table row, that plan is remapped per row (`_remap`, a dozen ops) instead of planned again."""
        rows = sorted({kv_mtp.layer_kv("swa", j)[2] for j in steps})
        if meta.swa_rows is None:
            ctx = _context(meta, meta.swa_page_table, kv_mtp.page_size, self.cfg.window_left, meta.positions,
                           self._rope_swa, self.inv_freq_swa, self.dtype, swa=True)
            return dict.fromkeys(rows, ctx)
        picked = meta.swa_rows[torch.tensor(rows, device=meta.swa_rows.device)]
        ctxs = _contexts_of(meta, meta.swa_page_table, picked, kv_mtp.page_size, self.cfg.window_left,
                            meta.positions, self._rope_swa, self.inv_freq_swa, self.dtype, swa=True)
        return dict(zip(rows, ctxs, strict=True))

    @torch.inference_mode()
    def forward_mtp(self, step: int, input_ids: torch.Tensor, prev_hidden: torch.Tensor, meta: BatchMeta,
                    kv_mtp: KVPools, contexts: dict[int, AttnContext] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP draft step ``step``: token ids (the token following each position) and the previous stage's
        hidden states ``[T, hidden]`` -> (float32 logits at ``meta.logits_rows()``, hidden ``[T, hidden]``).
        Step j runs MTP block min(j, L - 1) of the model's L: steps past the last block reuse it, chained (each
        step reads the one before's hidden states). ``kv_mtp`` comes from :meth:`KVPools.allocate_mtp` (or the
        engine's draft view, one layer per draft step); its SWA layer ``step`` holds this step's KV, so a reused
        block keeps one KV layer per step. ``contexts``: attention plans by page-table row, filled and reused
        by calls that share ``meta`` (the steps of one drafting pass over the same positions plan once)."""
        if self.model.mtp is None or step < 0 or step >= kv_mtp.num_layers("swa"):
            raise ValueError(f"MTP step {step} requested but the model has {self.cfg.num_mtp_layers} MTP layers "
                             f"and the draft pools {kv_mtp.num_layers('swa')} layers")
        block = self.model.mtp.layers[min(step, len(self.model.mtp.layers) - 1)]
        k, v, row = kv_mtp.layer_kv("swa", step)
        ctx = contexts.get(row) if contexts is not None else None
        if ctx is None:
            table = meta.swa_page_table if meta.swa_rows is None else meta.swa_rows[row]
            ctx = _context(meta, table, kv_mtp.page_size, self.cfg.window_left, meta.positions, self._rope_swa,
                           self.inv_freq_swa, self.dtype, swa=True)
            if contexts is not None:
                contexts[row] = ctx
        emb = self.model.embed_tokens(input_ids)
        h = block(emb, prev_hidden, ctx, k, v)
        return self.lm_head(h.index_select(0, meta.logits_rows())).float(), h


def _mlp_weights(mlp: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    if isinstance(mlp, MoE):
        return mlp.gate.weight, mlp.gate.e_score_correction_bias, mlp.experts.gate_up_proj, mlp.experts.down_proj
    m = cast(MLP, mlp)
    return m._gate_up.get((m.gate_proj.weight, m.up_proj.weight)), m.down_proj.weight


def _check_decode_pages(table: torch.Tensor, kv_lens: list[int], page: int, window_left: int) -> None:
    """Every page a decode step reads or writes is mapped (the attention plan's check, for the decode graph)."""
    last = [(n - 1) // page for n in kv_lens]
    first = [0 if window_left < 0 else max(0, n - 1 - window_left) // page for n in kv_lens]
    if max(last) >= table.shape[1]:
        b = last.index(max(last))
        raise ValueError(f"attention read, sequence {b}: position {kv_lens[b] - 1} needs logical page {last[b]} but "
                         f"the page table has only {table.shape[1]} columns")
    cols = torch.arange(table.shape[1], device=table.device)
    lo = torch.tensor(first, device=table.device)[:, None]
    hi = torch.tensor(last, device=table.device)[:, None]
    bad = (table < 0) & (cols >= lo) & (cols <= hi)
    if bool(bad.any()):
        b, j = (int(x) for x in torch.nonzero(bad)[0])
        raise ValueError(f"attention read, sequence {b}: logical page {j} is unmapped (-1) but holds positions that "
                         f"must be used")


def _decode_keys(table: torch.Tensor, kv_lens: torch.Tensor, kcol: torch.Tensor, window_left: int,
                 page: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(write slot [B], key slots [B, N], hidden [B, 1, N]) of one decode token per sequence: the keys are
    positions [lo, kv) (lo = kv - 1 - window_left, or 0), padded to N = len(kcol) with the last key, masked."""
    last = kv_lens - 1
    lo = (last - window_left).clamp(min=0) if window_left >= 0 else torch.zeros_like(last)
    valid = kcol[None, :] < (kv_lens - lo)[:, None]
    pos = torch.where(valid, lo[:, None] + kcol[None, :], last[:, None])
    slots = table.gather(1, torch.div(pos, page, rounding_mode="floor")) * page + pos % page
    write = table.gather(1, torch.div(last, page, rounding_mode="floor")[:, None])[:, 0] * page + last % page
    return write, slots, ~valid[:, None, :]


def _decode_step(input_ids: torch.Tensor, kv_lens: torch.Tensor, ctxs: list[tuple], logits_rows: torch.Tensor,
                 bufs: list[torch.Tensor], weights: list[tuple], shared: tuple,
                 consts: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole decoder over one new token per sequence, as one function of tensors for `torch.compile`, from
    `kernels/fused.py` (the KV write is the one opaque op in it). `ctxs`: per (group, table row) (cos, sin, page
    table [B, W], key columns [N]); `consts`: the per-layer structure (context, buffers, plane, window, heads,
    dims, scales, MoE or not) and the model's constants."""
    layers, page, eps, top_k, n_group, topk_group, renorm, scaling = consts
    embed_w, norm_w, lm_w = shared
    h = F.embedding(input_ids, embed_w)
    t = h.shape[0]
    keys: dict[tuple[int, int], tuple] = {}  # (context, window): slots, computed once per group and row
    for (ci, kb, vb, plane, window_left, hq, hkv, d, v_scale, scale, is_moe), w in zip(layers, weights, strict=True):
        cos, sin, table, kcol = ctxs[ci]
        if (ci, window_left) not in keys:
            keys[ci, window_left] = _decode_keys(table, kv_lens, kcol, window_left, page)
        write_slots, slots, hidden = keys[ci, window_left]
        q, k, v = fused.qkv_rope(fused.rms_norm(h, w[0], eps), cos, sin, w[1], hq, hkv, d, v_scale)
        out = fused.decode_attention(q, k, v, bufs[kb], bufs[vb], plane, write_slots, slots, hidden, scale, w[2])
        h, x = fused.add_rms_norm(h, F.linear(out.reshape(t, -1), w[3]), w[4], eps)
        if is_moe:
            h = h + fused.moe(x, w[5], w[6], w[7], w[8], top_k, n_group, topk_group, renorm, scaling)
        else:
            h = h + fused.swiglu(x, w[5], w[6])
    h = fused.rms_norm(h, norm_w, eps)
    return F.linear(h.index_select(0, logits_rows), lm_w).float(), h


def _rows_used(kv: KVPools, n_swa: int) -> int:
    """Table rows the decoder's SWA layers read (the MTP draft layers' chunks after them are not planned)."""
    if kv.arena is None or n_swa == 0:
        return 1
    return max(kv.arena.where("swa", i)[2] for i in range(n_swa)) + 1


def init_random_(model: MiMoV2Model, seed: int = 0) -> MiMoV2Model:
    """Deterministic random weights (same values in every process), scaled so logits are not flat."""
    g = torch.Generator().manual_seed(seed)
    h = model.cfg.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
                continue
            if name.endswith("embed_tokens.weight") or name.endswith("attention_sink_bias"):
                std = 1.0
            elif name == "lm_head.weight":
                std = 4.0 / math.sqrt(h)
            else:
                std = 1.0 / math.sqrt(p.shape[-1])
            p.copy_(torch.randn(p.shape, generator=g) * std)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.1)
    return model
