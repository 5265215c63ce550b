"""The package layout pinned: imports run one way (models ← lora ← parallel ← policy ← trainer, serve;
rl stands alone; chat and sandbox <- tasks <- envs; traces sit between envs and the faces that record and learn), no
source file grows past ~400 lines, and the CLI needs to know one error class."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "trillora"
MAX_LINES = 400

EVERYTHING = {
    "errors",
    "rl",
    "tasks",
    "models",
    "checkpoint",
    "lora",
    "parallel",
    "rollout",
    "config",
    "plots",
    "trainer",
    "tiny",
    "serve",
    "cli",
    "context",
    "policy",
    "traces",
    "plan",
    "envs",
    "chat",
    "sandbox",
}
ALLOWED = {
    "errors": set(),
    "rl": {"errors"},
    "chat": {"errors"},
    "sandbox": {"errors"},
    "tasks": {"errors", "chat", "sandbox"},
    "envs": {"errors", "tasks", "chat", "sandbox"},
    "context": {"errors", "tasks"},
    "models": {"errors"},
    "checkpoint": {"errors", "models"},
    "lora": {"errors", "models", "checkpoint"},
    "parallel": {"errors", "models", "lora", "rl"},
    "plan": {
        "errors",
        "models",
        "lora",
        "parallel",
    },  # the planner prices the engine's layouts; the engine never asks it
    "rollout": {"errors", "models", "lora", "checkpoint"},
    "config": {"errors", "lora", "parallel", "rl", "rollout", "tasks"},
    "plots": {"errors"},
    "policy": {"errors", "models", "checkpoint", "lora", "parallel", "rl", "rollout"},
    "trainer": EVERYTHING - {"cli", "tiny", "serve"},
    "traces": {"errors", "tasks", "envs"},
    "serve": {
        "errors",
        "models",
        "checkpoint",
        "lora",
        "parallel",
        "rl",
        "rollout",
        "policy",
        "tasks",
        "envs",
        "chat",
        "traces",
    },
    "tiny": EVERYTHING - {"cli", "serve"},
    "cli": EVERYTHING,
    "__init__": {"checkpoint", "models"},
    "__main__": {"cli"},
}
"""Which top-level parts of trillora each part may import (lazily inside functions included)."""


def imported_parts(path: Path) -> set[str]:
    """Top-level trillora parts a module imports, relative imports resolved."""
    rel = path.relative_to(SRC).with_suffix("")
    package = ["trillora", *rel.parts[:-1]]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = base + (node.module.split(".") if node.module else [])
            if target[:1] == ["trillora"]:
                out |= set(target[1:2]) if len(target) > 1 else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("trillora.")}
    return {p.removesuffix(".py") for p in out}


def part_of(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py")


def test_the_import_resolver_sees_relative_and_lazy_imports(tmp_path):
    assert imported_parts(SRC / "trainer" / "loop.py") >= {"rl", "lora", "checkpoint", "config"}
    assert "lora" in imported_parts(SRC / "plan" / "cost.py")  # imported inside a function
    assert imported_parts(SRC / "rl" / "loss.py") <= {"rl"}


def test_imports_run_one_way():
    wrong = []
    for path in sorted(SRC.rglob("*.py")):
        part = part_of(path)
        for other in imported_parts(path) - {part}:
            if other not in ALLOWED[part]:
                wrong.append(f"{path.relative_to(SRC)} imports trillora.{other}")
    assert not wrong, "\n".join(wrong)


def test_models_export_no_rl_names():
    """Router replay and routing records are hooks applied from outside; a MoE block holds no RL state."""
    from hf_models import CONFIGS

    import trillora.models as models
    from trillora.models import MoE, from_hf_config

    assert not {n for n in models.__all__ if "routing" in n or "replay" in n}
    block = MoE(from_hf_config(CONFIGS["qwen3_moe"]))
    assert {k for k in vars(block) if not k.startswith("_")} <= {"training"}


def test_no_source_file_is_over_400_lines():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_every_user_facing_error_is_a_trillora_error():
    """The CLI catches `TrilloraError` once; each class a user can meet derives from it."""
    from trillora.checkpoint import CheckpointError
    from trillora.checkpoint.train_state import CheckpointCorrupt
    from trillora.config import ConfigError as RunConfigError
    from trillora.errors import ConfigError, MissingPath, TrainingDiverged, TrilloraError
    from trillora.lora import AdapterError, LoraConfigError
    from trillora.models import ConfigError as ModelConfigError
    from trillora.parallel import ParallelError
    from trillora.rollout import EngineError
    from trillora.rollout.vllm_sync import SyncError
    from trillora.sandbox.jail import SandboxUnavailable
    from trillora.tasks import DatasetError
    from trillora.tasks.guard import RewardError

    assert RunConfigError is ModelConfigError is ConfigError
    for cls in (
        CheckpointError,
        CheckpointCorrupt,
        ConfigError,
        MissingPath,
        TrainingDiverged,
        AdapterError,
        LoraConfigError,
        ParallelError,
        EngineError,
        SyncError,
        DatasetError,
        RewardError,
        SandboxUnavailable,
    ):
        assert issubclass(cls, TrilloraError), cls
    classes = [
        n.name
        for p in SRC.rglob("*.py")
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.ClassDef) and n.name.endswith(("Error", "Corrupt", "Diverged", "Unavailable"))
    ]
    assert len(classes) == len(set(classes)), "an error class is defined twice"


def test_logprobs_are_read_off_the_head_in_one_place():
    """The faces and the context layer take logprobs from the core (`policy.logprobs`,
    `rl.logprobs.log_distribution`); none computes its own log-softmax."""
    found = [
        str(p.relative_to(SRC))
        for part in ("serve", "context")
        for p in (SRC / part).rglob("*.py")
        if "log_softmax" in p.read_text()
    ]
    assert not found, found


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The trillora modules a file imports, anywhere in it (lazily, under TYPE_CHECKING too):
    `from .x import y` counts `pkg.x.y` when that is a module, else `pkg.x`."""
    rel = path.relative_to(SRC.parent).with_suffix("")
    here = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
    package = here.split(".") if path.name == "__init__.py" else here.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            out |= {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return (out & modules) - {here}


def test_no_module_imports_itself_through_others():
    """No file-level import circle in src/trillora, lazy and TYPE_CHECKING imports counted: a face's
    routes read the server through a Protocol (`serve/face.py`), not the app that mounts them."""
    files = {
        ".".join(p.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in SRC.rglob("*.py")
    }
    graph = {m: imported_modules(p, set(files)) for m, p in files.items()}
    circles = []
    for start in sorted(graph):  # a depth-first walk from each module back to itself
        stack, seen = [(start, (start,))], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    circles.append(" -> ".join((*trail, start)))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, (*trail, nxt)))
    assert not circles, "\n".join(sorted(circles)[:10])


def test_the_openai_face_and_the_shared_serve_modules_import_nothing_of_tinker():
    """`serve/` is an HTTP layer, the shared pieces and two faces: the OpenAI face and what both
    faces share reach no Tinker module, lazily or for typing either (only `app` mounts both)."""
    files = {
        ".".join(p.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in SRC.rglob("*.py")
    }
    serve = SRC / "serve"
    shared = [p for p in serve.glob("*.py") if p.name not in ("app.py", "__init__.py")]
    openai = list((serve / "openai").glob("*.py"))
    assert openai and shared
    reached = {
        str(p.relative_to(SRC)): sorted(
            m for m in imported_modules(p, set(files)) if m.startswith("trillora.serve.tinker")
        )
        for p in shared + openai
    }
    assert not {k: v for k, v in reached.items() if v}
