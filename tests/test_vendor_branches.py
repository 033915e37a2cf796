"""Vendor as data (docs/architecture.md, "Architectures"): outside the vendor packages (backends/cuda, backends/rocm)
code reads an architecture's record instead of comparing vendor or architecture names. This lists every such
comparison left and fails when one is added (or when one listed here is gone: then drop it from the list).

A comparison is counted when it compares with (or tests ``startswith`` against) a vendor name ("cuda", "hip",
"rocm", "xpu") or an architecture name ("sm90", "gfx942", ...), or reads ``torch.version.hip`` / ``.cuda`` to
decide. Device-type checks (``device.type == "cuda"``) ask where a tensor lives, not which vendor built the GPU
(torch calls ROCm GPUs "cuda" too) and are not counted."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("indexcache", "backends", "bench")
VENDOR_PACKAGES = ("backends/cuda", "backends/rocm")
VENDOR_NAMES = {"cuda", "hip", "rocm", "xpu"}
ARCH_NAME = re.compile(r"^(sm|gfx)\d")

# Each comparison left, by file and source text, and why it stays.
ALLOWED = {
    ("backends/triton/launcher.py", 'kernel.metadata.target.backend != "cuda"'):
        "Triton's own record of the backend that compiled a kernel: the resident-block count is NVIDIA's "
        "occupancy rule (hal.device.resident_blocks), read from that build's registers and shared memory",
}


def _strings(node: ast.AST) -> list[str]:
    """The string constants of ``node``, or of the items of a tuple, list or set literal."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]


def _named(text: str, vendor_too: bool = True) -> bool:
    return (vendor_too and text in VENDOR_NAMES) or bool(ARCH_NAME.match(text))


def _device_type(node: ast.AST) -> bool:
    """``x.type`` (a torch.device's type), ``device_type`` or ``x.device_type``: where a tensor lives."""
    return (isinstance(node, ast.Attribute) and node.attr in ("type", "device_type")) or (
        isinstance(node, ast.Name) and node.id == "device_type")


def _runtime_read(node: ast.AST) -> bool:
    """``torch.version.hip`` / ``.cuda``, or ``getattr(torch.version, "hip", ...)``."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
        return node.value.attr == "version" and node.attr in VENDOR_NAMES
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
        args = node.args
        return (len(args) >= 2 and isinstance(args[0], ast.Attribute) and args[0].attr == "version"
                and any(_named(s) for s in _strings(args[1])))
    return False


def _branches(path: Path) -> list[str]:
    """The source text of each vendor or architecture name comparison in ``path``."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if not any(_device_type(s) for s in sides) and any(_named(t) for s in sides for t in _strings(s)):
                found.append(ast.get_source_segment(source, node))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith":
            if any(_named(t, vendor_too=False) for a in node.args for t in _strings(a)):
                found.append(ast.get_source_segment(source, node))
        elif isinstance(node, (ast.If, ast.IfExp, ast.While, ast.BoolOp, ast.UnaryOp)):
            tests = node.values if isinstance(node, ast.BoolOp) else [getattr(node, "test", getattr(node, "operand",
                                                                                                     None))]
            found += [ast.get_source_segment(source, t) for t in tests if _runtime_read(t)]
    return found


def _scan() -> Counter[tuple[str, str]]:
    """Each comparison outside the vendor packages as ``(file, source text)``, counted."""
    found: Counter[tuple[str, str]] = Counter()
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(tuple(p + "/" for p in VENDOR_PACKAGES)):
                found.update((rel, " ".join(text.split())) for text in _branches(path))
    return found


def test_vendor_branches_outside_the_vendor_packages_stay_the_listed_few():
    found, allowed = _scan(), Counter(ALLOWED.keys())
    added = sorted((found - allowed).elements())
    assert not added, ("vendor or architecture names compared outside backends/cuda and backends/rocm: "
                       f"{added}; read the architecture's record instead (docs/architecture.md, 'Architectures')")
    gone = sorted((allowed - found).elements())
    assert not gone, f"listed but no longer found (drop them from ALLOWED): {gone}"
    assert len(ALLOWED) <= 5


def test_the_scan_sees_each_kind_of_vendor_branch(tmp_path):
    """Control: on the kinds of branch this round removed, the scan finds each one."""
    path = tmp_path / "branches.py"
    path.write_text(
        "import torch\n"
        "a = target.vendor == 'cuda'\n"
        "b = arch in ('gfx942', 'gfx950')\n"
        "c = arch.startswith('gfx94')\n"
        "d = 64 if vendor == 'hip' else 32\n"
        "if getattr(torch.version, 'hip', None):\n    pass\n"
        "e = device.type == 'cuda'\n"  # where a tensor lives: not counted
        "f = {'cuda': torch.version.cuda}\n"  # read for display, not to decide: not counted
    )
    assert sorted(_branches(path)) == sorted(["target.vendor == 'cuda'", "arch in ('gfx942', 'gfx950')",
                                              "arch.startswith('gfx94')", "vendor == 'hip'",
                                              "getattr(torch.version, 'hip', None)"])
