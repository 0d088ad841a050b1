"""The bookkeeping half of the engine runs without torch, and imports point down only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "engine"

BLOCK_HEAVY = """
import sys

class Block:
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torch", "transformers", "triton", "numpy"):
            raise ImportError("blocked: " + name)

sys.meta_path.insert(0, Block())
"""

TORCH_FREE = """
from engine import EngineConfig, SamplingParams
from engine.mem_cache.allocator import TokenSlotAllocator
from engine.mem_cache.radix_cache import RadixCache
from engine.scheduler.request import Req
from engine.scheduler.scheduler import Scheduler

config = EngineConfig(model="unused", max_running_requests=2, chunked_prefill_size=16)
sched = Scheduler(config, 64, 32, 2)
sched.add_request(Req("a", [1, 2, 3, 4], SamplingParams(max_tokens=2), 0))
out = sched.schedule()
assert out is not None and out.batch.num_tokens == 4
sched.process_batch(out, {0: 7})
sched.check_integrity()
print("scheduled without torch")
"""


def test_scheduler_and_radix_cache_run_without_torch() -> None:
    code = BLOCK_HEAVY + TORCH_FREE
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "scheduled without torch" in done.stdout


def _engine_imports(path: Path) -> set[str]:
    """Modules of engine/ that `path` imports at run time (type-only imports excluded)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("engine"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("engine")}
    return found


def test_lower_layers_do_not_import_the_executor() -> None:
    low = ("models", "layers", "kernels", "mem_cache", "scheduler", "distributed")
    offenders = [
        f"{path.relative_to(ENGINE.parent)} imports {mod}"
        for part in low
        for path in sorted((ENGINE / part).rglob("*.py"))
        for mod in _engine_imports(path)
        if mod.startswith(("engine.executor", "engine.engine_core", "engine.llm"))
    ]
    assert not offenders, offenders


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {}
    for path in ENGINE.rglob("*.py"):
        rel = path.relative_to(ENGINE.parent).with_suffix("")
        name = ".".join(p for p in rel.parts if p != "__init__")
        graph[name] = {m for m in _engine_imports(path)}
    for name in graph:  # keep only edges to modules (a package import names its __init__)
        graph[name] = {m for m in graph[name] if m in graph and m != name}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
