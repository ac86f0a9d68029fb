"""The Gluon kernels' calls to each other's jit helpers match the helpers' parameters.

The Gluon kernels compile only with the Triton version they were written for (3.6, sm_90),
which CI does not have, and a kernel whose compile fails falls back to Triton at run time
with a warning: a helper whose signature changed under one kernel (the forward's
``_program_tiles`` and ``_scores`` once did, under the dQ kernel) would pass every CPU
test.  So the argument counts are checked from the source: every call of a ``@gluon.jit``
function of these modules, by its name, passes as many positional arguments as it takes
(no keywords are used between jit functions here)."""

from __future__ import annotations

import ast
import pathlib

import pytest

GLUON = pathlib.Path(__file__).resolve().parents[1] / "fp4_inductor" / "kernels" / "gluon"


def _jit_functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    def jit(fn):
        return any(ast.unparse(d).startswith(("gluon.jit", "gluon.constexpr_function")) for d in fn.decorator_list)

    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef) and jit(node)}


def _arity(fn: ast.FunctionDef) -> tuple[int, int]:
    """(required, total) positional parameters."""
    args = fn.args.posonlyargs + fn.args.args
    return len(args) - len(fn.args.defaults), len(args)


def _scope(name: str, modules: dict[str, ast.Module]) -> dict[str, ast.FunctionDef]:
    """The jit functions a module's code can call by name: its own, and those it imports
    from a sibling module (``from .attention_fwd import ...``)."""
    tree = modules[name]
    scope = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module in modules:
            theirs = _jit_functions(modules[node.module])
            scope.update({a.name: theirs[a.name] for a in node.names if a.name in theirs})
    scope.update(_jit_functions(tree))
    return scope


def _calls():
    modules = {path.stem: ast.parse(path.read_text()) for path in sorted(GLUON.glob("*.py"))}
    for name, tree in modules.items():
        helpers = _scope(name, modules)
        for caller in _jit_functions(tree).values():
            for node in ast.walk(caller):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in helpers:
                    yield name, caller.name, node, helpers[node.func.id]
                # warp_specialize([(fn, (args...)), ...]): partition functions and their argument tuples
                if isinstance(node, ast.Tuple) and len(node.elts) == 2 and isinstance(node.elts[0], ast.Name) \
                        and node.elts[0].id in helpers and isinstance(node.elts[1], ast.Tuple):
                    call = ast.Call(func=node.elts[0], args=node.elts[1].elts, keywords=[])
                    ast.copy_location(call, node)
                    yield name, caller.name, call, helpers[node.elts[0].id]


CALLS = list(_calls())


def test_calls_were_found():
    assert len(CALLS) > 30  # the forward, dQ and dK/dV kernels' helper calls
    assert {callee.name for *_, callee in CALLS} >= {"_program_tiles", "_scores", "_probability", "_consumer"}


@pytest.mark.parametrize("module,caller,call,callee", CALLS,
                         ids=[f"{m}.{c}:{n.lineno}->{f.name}" for m, c, n, f in CALLS])
def test_positional_arguments_match(module, caller, call, callee):
    if any(isinstance(a, ast.Starred) for a in call.args) or call.keywords:
        pytest.skip("starred or keyword arguments: counted at compile time only")
    required, total = _arity(callee)
    assert required <= len(call.args) <= total, (
        f"{module}.{caller} line {call.lineno} calls {callee.name} with {len(call.args)} positional arguments; "
        f"it takes {required}..{total}")
