"""The package's shape (issue: one shape for the codebase): no import cycles, the library apart from its
benchmark, environment variables read in one module, ``python -m moeblaze`` as the console script; the repository
speaks of the project alone (issue 60: none of the words of how it is worked on, in any tracked text file)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import moeblaze
from moeblaze import settings

SRC = Path(moeblaze.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every moeblaze module ``path`` imports, at the top or inside functions (lazy imports count)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    # annotations only (``if TYPE_CHECKING:``): nothing is imported when the module runs
    typing_only = {id(n) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING" for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("moeblaze")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("moeblaze"):
                continue
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}  # `from . import settings` names a module
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for dep in _imports(path):
            while dep and dep not in modules:  # `from .x import f` -> module x
                dep = dep.rpartition(".")[0]
            if dep and dep != name and not name.startswith(dep + "."):  # `from . import x`: x, not the package
                deps.add(dep)
        graph[name] = deps
    return graph


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep] if dep in stack else [node, dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


# The layers of the package, lowest first: a module imports only modules of its own layer or below. The layer itself
# (routing, dispatch, experts and their kernels) at the bottom; parallelism wraps it; the training application uses
# both; the command line and the benchmarks sit on top. A module not listed belongs to the layer of its package.
_LAYERS = {"moeblaze.parallel": 1, "moeblaze.integrations": 1, "moeblaze.training": 2, "moeblaze.bench": 3,
           "moeblaze.cli": 3, "moeblaze.__main__": 3}


def _layer(module: str) -> int:
    return max((v for k, v in _LAYERS.items() if module == k or module.startswith(k + ".")), default=0)


def test_no_import_from_a_lower_layer_to_a_higher_one():
    upward = sorted(f"{m} -> {d}" for m, deps in _graph().items() for d in deps if _layer(d) > _layer(m))
    assert not upward, "imports from a lower layer to a higher one: " + "; ".join(upward)


def test_the_router_does_not_import_token_rounding():
    """Token rounding is opt-in: the router reaches it only through the request it is handed."""
    assert "moeblaze.token_rounding" not in _graph()["moeblaze.routing"]


def test_library_does_not_import_its_benchmark():
    offenders = [m for m, deps in _graph().items()
                 if not m.startswith("moeblaze.bench") and m != "moeblaze.cli"
                 and any(d.startswith("moeblaze.bench") for d in deps)]
    assert not offenders, f"these modules import moeblaze.bench: {offenders}"


def test_environment_read_only_in_settings():
    offenders = []
    for path in SRC.rglob("*.py"):
        name = _module_name(path)
        if name == "moeblaze.settings" or name.startswith("moeblaze.bench"):
            continue
        text = path.read_text()
        if "os.environ" in text or "os.getenv" in text:
            offenders.append(name)
    assert not offenders, f"environment read outside moeblaze.settings: {offenders}"


def test_python_dash_m_is_the_console_script():
    run = subprocess.run([sys.executable, "-m", "moeblaze", "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "train" in run.stdout and "bench" in run.stdout


def test_settings_precedence(monkeypatch):
    monkeypatch.setenv("MOEBLAZE_AUTOTUNE", "0")
    assert settings.get("autotune") is False
    settings.configure(autotune=True)
    try:
        assert settings.get("autotune") is True
        with settings.override(autotune=False, backend="torch"):
            assert settings.get("autotune") is False and settings.get("backend") == "torch"
            with settings.override(backend="triton"):
                assert settings.get("backend") == "triton" and settings.get("autotune") is False
        assert settings.get("autotune") is True
    finally:
        settings.reset()
    assert settings.get("autotune") is False
    monkeypatch.delenv("MOEBLAZE_AUTOTUNE")
    assert settings.get("autotune") is True
    monkeypatch.setenv("MOEBLAZE_CHUNK_COLS", "512")
    assert settings.get("chunk_cols") == 512
    monkeypatch.setenv("MOEBLAZE_BACKEND", "Torch")  # any case, as the boolean and column settings
    assert settings.get("backend") == "torch"
    monkeypatch.delenv("MOEBLAZE_BACKEND")
    monkeypatch.delenv("MOEBLAZE_CHUNK_COLS")
    assert settings.get("chunk_cols") == "auto"


@pytest.mark.parametrize("call, match", [
    (lambda: settings.get("nope"), "unknown moeblaze setting 'nope'"),
    (lambda: settings.configure(check_ids="maybe"), "setting 'check_ids' must be a boolean"),
    (lambda: settings.configure(tma=False), "unknown moeblaze setting 'tma'"),  # chosen by the device (sm90+)
    (lambda: settings.configure(backend="cuda"), "setting 'backend' must be one of"),
])
def test_settings_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_settings_bad_environment(monkeypatch):
    monkeypatch.setenv("MOEBLAZE_CHECK_IDS", "sometimes")
    with pytest.raises(ValueError, match="MOEBLAZE_CHECK_IDS must be a boolean"):
        settings.get("check_ids")


@pytest.mark.parametrize("var, value", [("MOEBLAZE_BACKEND", "foo"), ("MOEBLAZE_AUTOTUNE", "maybe"),
                                        ("MOEBLAZE_CHUNK_COLS", "17")])
def test_the_command_line_checks_the_environment_before_it_starts(var, value, monkeypatch, capsys, tmp_path):
    """A malformed variable is one line and exit 2 before anything runs, not a traceback when (and if) the run
    first reads it (MOEBLAZE_AUTOTUNE, for one, is never read on the CPU)."""
    from moeblaze.cli import main

    monkeypatch.setenv(var, value)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["train", "--data", str(tmp_path / "missing.txt")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith(f"moeblaze train: error: {var} must be") and err.count("\n") == 1
    monkeypatch.delenv(var)
    settings.check_environment()


def test_five_settings_and_no_kernel_variant_switches():
    """The switches a user changes; kernel variants are chosen by device and shape, the router's, rounding's and
    dispatch's kernels by ``backend``: their former settings are unknown names."""
    assert sorted(settings.SETTINGS) == ["autotune", "backend", "check_ids", "chunk_cols", "deterministic"]
    gone = ("tma", "persistent", "wgrad_persistent", "ws_wgrad", "ws_gemm", "wgrad_tma_store", "dispatch",
            "compile_rounding", "fused_router", "fused_rounding")
    for name in gone:
        with pytest.raises(ValueError, match=f"unknown moeblaze setting '{name}'"), settings.override(**{name: "1"}):
            pass
    variables = re.compile(r"MOEBLAZE_(?:" + "|".join(g.upper() for g in gone) + r")\b")
    root = SRC.parents[1]
    for path in [root / "README.md", *(p for d in ("src", "benchmarks", "scripts", "docs", "examples", "tests")
                                        for p in (root / d).rglob("*") if p.suffix in (".py", ".md", ".sh"))]:
        assert not variables.search(path.read_text()), f"{path} names a removed variable"


def test_environment_written_after_import_is_read_as_os_environ_reads_it(monkeypatch):
    """settings reads os.environ's store (a fast path on POSIX): writes after import, removals and non-ASCII
    values read as ``os.environ.get`` returns them."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert settings.interpreting()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not settings.interpreting()
    monkeypatch.setenv("MOEBLAZE_BACKEND", "t\u00f8rch")
    assert settings._getenv("MOEBLAZE_BACKEND") == os.environ.get("MOEBLAZE_BACKEND") == "t\u00f8rch"
    with pytest.raises(ValueError, match="got 't\u00f8rch'"):
        settings.get("backend")
    monkeypatch.delenv("MOEBLAZE_BACKEND")
    assert settings._getenv("MOEBLAZE_BACKEND") is None and settings.get("backend") == "auto"
    monkeypatch.setattr(os, "environ", {"MOEBLAZE_BACKEND": "torch"})  # a harness's plain mapping
    assert settings.get("backend") == "torch"


def test_override_routes_the_backend(monkeypatch):
    """The ``backend`` setting picks what ``backend="auto"`` runs (here: a bad value is refused by name)."""
    import torch

    x = torch.randn(4, 8)
    ids = torch.zeros(4, 1, dtype=torch.int32)
    w = torch.ones(4, 1)
    w1, w2 = torch.randn(2, 16, 8), torch.randn(2, 8, 8)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with settings.override(backend="triton"), pytest.raises(
            ValueError, match=r"the backend setting 'triton' \(moeblaze.settings, MOEBLAZE_BACKEND\) needs CUDA"):
        moeblaze.moe_experts(x, ids, w, w1, w2)
    with pytest.raises(ValueError, match="backend='triton' needs CUDA"):  # the argument: named as such
        moeblaze.moe_experts(x, ids, w, w1, w2, backend="triton")
    with settings.override(backend="torch"):
        assert moeblaze.moe_experts(x, ids, w, w1, w2).shape == (4, 8)


def test_backend_setting_picks_the_router_rounding_and_dispatch_kernels(monkeypatch):
    """One rule (``settings.use_triton``) for the Triton router, token rounding's selections and the dispatch build:
    ``auto`` on CUDA tensors, ``triton`` on CUDA tensors and, under the interpreter, CPU tensors, ``torch`` on none;
    the rounding compiles on CUDA tensors unless ``torch``."""
    import torch

    from moeblaze import dispatch, token_rounding
    from moeblaze.routing import Router

    cpu = torch.zeros(4, 8)
    router = Router(8, 8, 2)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for backend, want in (("auto", False), ("triton", True), ("torch", False)):
        with settings.override(backend=backend):
            assert settings.use_triton(cpu) is want
            assert router._fused(cpu) is want
            assert token_rounding._kernels_serve(cpu, 2, (torch.float32,)) is want
            assert dispatch._triton_serves(cpu[:, :2].int(), 8) is want
            assert not token_rounding._compiles(cpu)
    monkeypatch.delenv("TRITON_INTERPRET")
    with settings.override(backend="triton"):
        assert not settings.use_triton(cpu)  # CPU tensors without the interpreter: the PyTorch ops
    if torch.cuda.is_available():
        gpu = cpu.cuda()
        for backend in ("auto", "triton", "torch"):
            with settings.override(backend=backend):
                assert settings.use_triton(gpu) is token_rounding._compiles(gpu) is (backend != "torch")


def test_host_cdiv_and_next_pow2_equal_triton_s():
    """The launchers' integer helpers give ``triton.cdiv`` / ``triton.next_power_of_2``'s values (theirs cost
    ~1.5 µs of Python per call since triton 3.5)."""
    import triton

    from moeblaze.kernels.tuning import cdiv, next_pow2

    for n in [0, 1, 2, 3, 4, 5, 7, 8, 9, 127, 128, 129, 257, 1000, 1024, 2**31 + 5]:
        assert next_pow2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 64, 128, 4096):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


def _backward_on_another_thread(loss, own: dict | None = None) -> None:
    """``loss.backward()`` on a new thread, as autograd runs a CUDA backward on its device thread (this thread's
    overrides do not reach it); ``own``: that thread's own override."""
    import threading

    errors = []

    def run():
        try:
            with settings.override(**(own or {})):
                loss.backward()
        except Exception as err:  # noqa: BLE001 (re-raised on the test's thread)
            errors.append(err)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "backward did not finish"
    if errors:
        raise errors[0]


def test_forward_overrides_govern_the_backward_on_another_thread(monkeypatch):
    """An override in effect during the forward is what the backward's ops read, also where the backward runs on
    another thread (autograd's device thread on CUDA); that thread's own override wins; none: the environment."""
    import torch

    from moeblaze.backends import get_backend

    backend = get_backend("torch", torch.zeros(1))
    seen = []
    orig = backend.down_backward
    spy = lambda *a, **k: seen.append(settings.get("autotune")) or orig(*a, **k)  # noqa: E731
    monkeypatch.setattr(backend, "down_backward", spy)
    monkeypatch.delenv("MOEBLAZE_AUTOTUNE", raising=False)
    moe = moeblaze.MoE(16, 8, num_experts=4, top_k=2, backend="torch")
    x = torch.randn(12, 16)
    for forward_scope, own, expected in [({"autotune": False}, None, False), ({"autotune": False}, {"autotune": True},
                                         True), ({}, None, True)]:
        with settings.override(**forward_scope):
            loss = moe(x).square().sum()
        _backward_on_another_thread(loss, own)
        assert seen.pop() is expected, (forward_scope, own)
    with settings.override(autotune=False):  # the same thread: as before
        moe(x).square().sum().backward()
    assert seen.pop() is False


ROOT = Path(__file__).resolve().parents[1]
# Issue 60's words, whole words in any case (a phrase may break across a line and a comment's "#"); spelled with
# a bracket here so that this file does not hold them itself.
WORK_WORDS = re.compile(r"(?<![\w$])(?:se[s]sions?|le[n]t|ca[l]ls|device[\s#\"']+machines?)(?!\w)"
                        r"|(?<!\w)\$\{?O[U]T(?!\w)", re.IGNORECASE)


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout: no list of tracked files")
    return [name for name in out.decode().split("\0") if name]


@pytest.mark.parametrize("text, found", [
    ("in a new " + "ses" + "sion", True), ("two " + "SES" + "SIONS", True), ("on the " + "le" + "nt H200s", True),
    ("a device\n    # " + "machine's CPU", True), ("writes under $" + "OUT/x", True), ('"${' + 'OUT}"', True),
    ("start_new_" + "ses" + "sion=True", False), ("si" + "le" + "nt", False), ("$" + "OUTPUT", False),
    ("a device, a machine", False), ("OUT=1", False), ("in two " + "ca" + "lls", True), ("re" + "ca" + "lls", False),
    ("one call", False),
])
def test_work_words_pattern(text, found):
    assert bool(WORK_WORDS.search(text)) is found


def test_no_words_of_how_the_project_is_worked_on():
    """No tracked text file (binary ones, e.g. PNG, skipped) holds the words of :data:`WORK_WORDS`."""
    hits = []
    for name in _tracked_files():
        path = ROOT / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        text = data.decode("utf-8", "replace")
        hits += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for m in WORK_WORDS.finditer(text)]
    assert not hits, "words of how the project is worked on:\n" + "\n".join(hits)
