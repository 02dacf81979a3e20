"""The compiled step: `torch.compile` (inductor) over the model's forward (`kernels/fused.py`; docs/engine.md).

Contract: a pure decode step is one compiled graph over the whole decoder (`decode`); every other step runs
the layers eager with their dense segments compiled (`run`). One token gets a graph of its own, 2 <= T <=
`max_tokens` share dynamic-shape graphs; larger steps, and any graph whose compilation failed, run eager and
are counted in `fallbacks`. `warm_up` compiles every graph before the engine serves, within a time bound,
with the compiled code cached on disk under `cache_dir`. Results equal the eager path up to floating-point
reassociation. Details: docs/engine.md, "Compiled step".
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kernels import fused

log = logging.getLogger(__name__)

SEGMENTS: dict[str, Callable] = {
    "qkv_rope": fused.qkv_rope,
    "add_rms_norm": fused.add_rms_norm,
    "swiglu": fused.swiglu,
    "moe": fused.moe,
}

RECOMPILE_LIMIT = 64
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "windserve" / "torch-compile"


class CompiledStep:
    """Compiled versions of the `SEGMENTS`, called by the layers through `run` (one per model)."""

    def __init__(self, max_tokens: int, cache_dir: str | Path | None = None) -> None:
        if max_tokens < 1:
            raise ValueError(f"CompiledStep: max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.cache_dir = Path(cache_dir) if cache_dir else DEFAULT_CACHE_DIR
        # inductor reads its cache location from the environment each time it compiles
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(self.cache_dir))
        # graphs are per model shape and per function: a process holding several models (tests, a benchmark)
        # passes dynamo's default of 8 graphs per function, and fullgraph makes that a hard failure
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
        self.fallbacks: Counter[str] = Counter()
        self.compiled_calls = 0
        self.warmup_s: float | None = None
        self._fns = {name: torch.compile(fn, fullgraph=True) for name, fn in SEGMENTS.items()}
        self._decode_fns: dict[Callable, Callable] = {}
        self._broken: set[str] = set()

    def run(self, name: str, acts: Sequence[torch.Tensor], *rest):
        """SEGMENTS[name](*acts, *rest), compiled where it can be. `acts` are the tensors whose first dim is the
        step's token count (marked dynamic past one token); `rest` the weights and constants."""
        t = acts[0].shape[0]
        if name in self._broken:
            return self._eager(name, "compile_failed", acts, rest)
        if t > self.max_tokens:
            return self._eager(name, "tokens_over_max", acts, rest)
        if t > 1:
            for a in acts:
                torch._dynamo.maybe_mark_dynamic(a, 0)
        try:
            out = self._fns[name](*acts, *rest)
        except Exception:  # a backend or lowering failure: that segment runs eager from now on
            log.exception("compiling %s failed; it runs eager from now on", name)
            self._broken.add(name)
            return self._eager(name, "compile_failed", acts, rest)
        self.compiled_calls += 1
        return out

    def decode(self, fn: Callable, input_ids: torch.Tensor, kv_lens: torch.Tensor, ctxs: list[tuple],
               logits_rows: torch.Tensor, *rest):
        """`fn` (the model's whole decode step, `libs.model.model._decode_step`) compiled, over one new token per
        sequence; None when the step must run eager instead (too many tokens, or its compilation failed), counted
        in `fallbacks`. The sequence count and every context's key count are the graph's dynamic dimensions."""
        t = input_ids.shape[0]
        if "decode" in self._broken:
            self.fallbacks["compile_failed"] += 1
            return None
        if t > self.max_tokens:
            self.fallbacks["tokens_over_max"] += 1
            return None
        compiled = self._decode_fns.get(fn)
        if compiled is None:
            compiled = self._decode_fns[fn] = torch.compile(fn, fullgraph=True)
        for _cos, _sin, table, kcol in ctxs:
            torch._dynamo.maybe_mark_dynamic(kcol, 0)
            torch._dynamo.maybe_mark_dynamic(table, 1)
        if t > 1:
            for a in (input_ids, kv_lens, logits_rows, *(x for c in ctxs for x in c[:3])):
                torch._dynamo.maybe_mark_dynamic(a, 0)
        try:
            out = compiled(input_ids, kv_lens, ctxs, logits_rows, *rest)
        except Exception:  # the eager layers rewrite whatever KV it wrote before failing
            log.exception("compiling the decode step failed; decode steps run eager from now on")
            self._broken.add("decode")
            self.fallbacks["compile_failed"] += 1
            return None
        self.compiled_calls += 1
        return out

    def _eager(self, name: str, reason: str, acts, rest):
        self.fallbacks[reason] += 1
        return SEGMENTS[name](*acts, *rest)

    def stats(self) -> dict:
        """What readiness and metrics report."""
        return {"enabled": True, "max_tokens": self.max_tokens, "warmup_s": self.warmup_s,
                "compiled_calls": self.compiled_calls, "fallbacks": dict(self.fallbacks),
                "broken_segments": sorted(self._broken), "cache_dir": str(self.cache_dir)}

    def warm_up(self, stages: Sequence[Callable[[], None]], bound_s: float) -> bool:
        """Compile every graph before serving by running `stages` (steps whose shapes select each graph: see
        `EngineCore._warmup_stages`). False when the bound ran out before the last stage began (checked between stages:
        one stage's compilation is not cut short)."""
        start = time.perf_counter()
        for i, stage in enumerate(stages):
            if time.perf_counter() - start > bound_s:
                self.warmup_s = time.perf_counter() - start
                log.warning("compile warm-up passed its bound (%.0f s) at stage %d of %d", bound_s, i, len(stages))
                return False
            stage()
        self.warmup_s = time.perf_counter() - start
        log.info("compiled step warm in %.1f s (cache %s)", self.warmup_s, self.cache_dir)
        return True
