"""The cache's structure: parts that own their state (docs/kvcache.md, "Parts"), checked from the source and
through each part's own audit."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from libs.kvcache import KVCache, KVCacheConfig, PageCopy
from libs.kvcache.tiers import HostTier, LowerTier, split_copies

pytestmark = pytest.mark.unit

KVCACHE = Path(__file__).resolve().parent.parent / "libs" / "kvcache"


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text()) for p in sorted(KVCACHE.glob("*.py"))}


def _imports(tree: ast.Module) -> set[str]:
    """libs.kvcache modules a module imports anywhere (top level, functions, TYPE_CHECKING blocks)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("libs.kvcache."):
            out.add(node.module.split(".")[2])
    return out


def test_kvcache_modules_import_no_circle() -> None:
    graph = {name: _imports(tree) for name, tree in _modules().items()}
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> None:
        if name in stack:
            raise AssertionError(f"import circle: {' -> '.join([*stack[stack.index(name):], name])}")
        if name in done:
            return
        for dep in sorted(graph.get(name, ())):
            visit(dep, [*stack, name])
        done.add(name)

    for name in graph:
        visit(name, [])


def test_no_module_reads_another_objects_private_attributes() -> None:
    """`x._name` only on self / cls: a part's private state is read and written by that part alone."""
    bad = []
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                bad.append(f"{name}.py:{node.lineno} .{node.attr}")
    assert not bad, bad


def test_kvcache_stays_pure() -> None:
    """No torch (and no IO library) behind `import libs.kvcache`."""
    code = ("import sys, libs.kvcache; bad = [m for m in ('torch', 'numpy', 'nats', 'asyncio') if m in sys.modules];"
            " print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=KVCACHE.parent.parent)
    assert out.stdout.strip() == ""


def _cache(host: int = 0) -> KVCache:
    return KVCache(KVCacheConfig(page_size=4, window=8, num_full_pages=32, num_swa_pages=16,
                                 num_host_full_pages=host, num_host_swa_pages=host), audit_tokens=True)


def _serve(c: KVCache, sid: str, tokens: list[int]) -> None:
    assert c.admit(sid, tokens, c.match(tokens), 2).ok
    assert c.reserve(sid, len(tokens))
    c.commit(sid, len(tokens), [7])
    c.finish(sid)


def test_ledger_audit_catches_a_transition_without_its_record() -> None:
    c = _cache()
    _serve(c, "a", list(range(20)))
    c.check_invariants()
    c.ledger.lock(1, 0)  # a lock nobody holds
    with pytest.raises(AssertionError, match="counters"):
        c.check_invariants()
    c.ledger.lock(-1, 0)
    c.ledger.promise(0, 1)  # a promise no sequence was made
    with pytest.raises(AssertionError, match="reserved counters"):
        c.check_invariants()


def test_reuse_stats_audit_catches_a_rebuild_count_without_its_hit() -> None:
    c = _cache()
    c.stats.rebuild_admitted(8)
    with pytest.raises(AssertionError, match="rebuild stats"):
        c.check_invariants()


def test_host_tier_is_a_lower_tier_and_audits_its_pools() -> None:
    assert _cache().tiers == ()
    c = _cache(host=16)
    assert [type(t) for t in c.tiers] == [HostTier] and isinstance(c.tiers[0], LowerTier)
    _serve(c, "a", list(range(20)))
    copies = c.backup_to_host(16)
    assert copies and all(p.direction == "d2h" for p in copies)
    assert c.usage().host_full.cached == sum(p.group == "full" for p in copies)
    c.check_invariants()
    node = next(n for n in c.index.nodes.values() if n.host_full is not None)
    node.host_full[0] = node.host_full[-1]  # one host page recorded twice, another lost
    with pytest.raises(AssertionError, match="host_full pool"):
        c.check_invariants()


def test_split_copies_keeps_the_last_copy_per_target_and_checks_direction() -> None:
    copies = [PageCopy("full", 1, 5, "h2d"), PageCopy("swa", 2, 3, "h2d"), PageCopy("full", 4, 5, "h2d")]
    assert split_copies(copies, "h2d") == {"full": ([4], [5]), "swa": ([2], [3])}
    with pytest.raises(ValueError, match="expected d2h"):
        split_copies(copies, "d2h")
    with pytest.raises(ValueError, match="unknown page-copy group"):
        split_copies([PageCopy("x", 0, 0, "d2h")], "d2h")
