"""kvserve.envs: the one table of KVSERVE_* variables, the one place that reads them.

A scan of the package's source (ast) finds every read of a KVSERVE_* name from os.environ /
os.getenv -- `os.environ.get(NAME)`, `os.environ[NAME]`, `os.getenv(NAME)`, `NAME in
os.environ`, with NAME a string or a module constant holding one -- and lists each one outside
kvserve/envs.py. Then the parsers: a bad value is a ValueError that names the variable."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvserve import envs

PACKAGE = Path(envs.__file__).parent


def _string_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = "KVSERVE_..." assignments."""
    out = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node.value.value
    return out


def _is_environ(node: ast.AST) -> bool:
    """`os.environ` or a bare `environ`."""
    return ((isinstance(node, ast.Attribute) and node.attr == "environ")
            or (isinstance(node, ast.Name) and node.id == "environ"))


def _read_name(node: ast.AST) -> ast.AST | None:
    """The name expression this node reads from the environment, if it is such a read."""
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "get" and _is_environ(func.value):
            return node.args[0] if node.args else None
        if ((isinstance(func, ast.Attribute) and func.attr == "getenv")
                or (isinstance(func, ast.Name) and func.id == "getenv")):
            return node.args[0] if node.args else None
    if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
            and _is_environ(node.value)):
        return node.slice
    if (isinstance(node, ast.Compare) and len(node.ops) == 1
            and isinstance(node.ops[0], (ast.In, ast.NotIn)) and _is_environ(node.comparators[0])):
        return node.left
    return None


def kvserve_env_reads(path: Path) -> list[str]:
    """'file:line NAME' for each read of a KVSERVE_* variable from the environment in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    constants = _string_constants(tree)
    found = []
    for node in ast.walk(tree):
        arg = _read_name(node)
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            name = arg.value
        elif isinstance(arg, ast.Name):
            name = constants.get(arg.id, "")
        else:
            continue
        if name.startswith("KVSERVE_"):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}")
    return found


def test_only_envs_reads_kvserve_variables() -> None:
    reads = [r for path in sorted(PACKAGE.rglob("*.py")) if path != PACKAGE / "envs.py"
             for r in kvserve_env_reads(path)]
    assert not reads, ("KVSERVE_* variables read outside kvserve/envs.py (use "
                       "kvserve.envs.get):\n" + "\n".join(reads))


def test_the_scan_finds_each_kind_of_read(tmp_path: Path) -> None:
    src = tmp_path / "mod.py"
    src.write_text('import os\nFLAG = "KVSERVE_FLAG"\n'
                   'a = os.environ.get("KVSERVE_A", "1")\n'
                   'b = os.environ[FLAG]\n'
                   'c = os.getenv("KVSERVE_C")\n'
                   'd = "KVSERVE_D" in os.environ\n'
                   'e = os.environ.get("HOME")\n'
                   'os.environ["KVSERVE_SET"] = "1"\n')
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path.parent
    try:
        reads = kvserve_env_reads(src)
    finally:
        PACKAGE = saved
    assert [r.split(" ")[1] for r in reads] == ["KVSERVE_A", "KVSERVE_FLAG", "KVSERVE_C",
                                               "KVSERVE_D"]


def test_every_variable_has_a_doc_and_a_known_kind() -> None:
    for var in envs.ENV_VARS.values():
        assert var.name.startswith("KVSERVE_") and var.doc
        assert var.kind in ("bool", "float", "int", "str", "choice")
        assert (var.kind == "choice") == bool(var.choices)
    for settled in ("KVSERVE_CPU_FLOAT32_COPY", "KVSERVE_CPU_SMALL_BATCH_COPY",
                    "KVSERVE_CPU_TILED_WEIGHTS", "KVSERVE_CPU_FUSED_DECODE"):
        assert settled not in envs.ENV_VARS     # A/B toggles the benchmarks settled


@pytest.mark.parametrize("raw,value", [("1", True), ("true", True), (" Yes ", True),
                                       ("ON", True), ("0", False), ("false", False),
                                       ("no", False), ("off", False)])
def test_bool(raw: str, value: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_DISABLE_CPU_KERNELS", raw)
    assert envs.get("KVSERVE_DISABLE_CPU_KERNELS") is value


def test_bad_values_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_DISABLE_CPU_KERNELS", "maybe")
    with pytest.raises(ValueError, match="KVSERVE_DISABLE_CPU_KERNELS must be one of 1/0"):
        envs.get("KVSERVE_DISABLE_CPU_KERNELS")
    monkeypatch.setenv("KVSERVE_ENGINE_STARTUP_TIMEOUT", "ten")
    with pytest.raises(ValueError, match="KVSERVE_ENGINE_STARTUP_TIMEOUT must be a number"):
        envs.get("KVSERVE_ENGINE_STARTUP_TIMEOUT")
    monkeypatch.setenv("KVSERVE_CPU_ISA", "avx3")
    with pytest.raises(ValueError, match="KVSERVE_CPU_ISA must be one of auto, generic, avx2"):
        envs.get("KVSERVE_CPU_ISA")


def test_values_defaults_and_undeclared_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_ENGINE_STARTUP_TIMEOUT", "12.5")
    assert envs.get("KVSERVE_ENGINE_STARTUP_TIMEOUT") == 12.5
    assert envs.KVSERVE_ENGINE_STARTUP_TIMEOUT == 12.5          # attribute access, same read
    monkeypatch.setenv("KVSERVE_CPU_ISA", " AVX2 ")
    assert envs.get("KVSERVE_CPU_ISA") == "avx2"
    monkeypatch.setenv("KVSERVE_CPU_HUGE_PAGES", "")           # empty counts as unset
    assert envs.get("KVSERVE_CPU_HUGE_PAGES") == "auto"
    monkeypatch.delenv("KVSERVE_DISABLE_CPU_KERNELS", raising=False)
    assert envs.get("KVSERVE_DISABLE_CPU_KERNELS") is False
    with pytest.raises(KeyError):
        envs.get("KVSERVE_NOT_DECLARED")
    with pytest.raises(AttributeError):
        envs.KVSERVE_NOT_DECLARED
