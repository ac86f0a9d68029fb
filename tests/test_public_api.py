"""The public API: ``__all__`` lists exactly the documented names, every record a public
function returns is itself public, and the version has one source (pyproject.toml reads
the package's)."""

import dataclasses
import typing
from pathlib import Path

import pytest
import torch

import fp4_inductor

PUBLIC = {"backend", "configure", "explain", "Report", "SiteRecord", "tune", "TuneResult", "calibrate",
          "Calibration", "scaled_dot_product_attention", "patch"}


def test_all_lists_the_public_names():
    assert len(fp4_inductor.__all__) == len(set(fp4_inductor.__all__))
    assert set(fp4_inductor.__all__) == PUBLIC
    namespace: dict = {}
    exec("from fp4_inductor import *", namespace)
    assert set(namespace) - {"__builtins__"} == PUBLIC


def _package_classes(hint) -> set:
    """The fp4_inductor classes a type hint names, inside containers and unions too."""
    found = {hint} if isinstance(hint, type) and hint.__module__.startswith("fp4_inductor") else set()
    for arg in typing.get_args(hint):
        found |= _package_classes(arg)
    return found


def test_what_users_get_back_is_public():
    returned, seen = set(), set()
    exported = {getattr(fp4_inductor, name) for name in fp4_inductor.__all__}
    pending = list(exported)
    while pending:  # the public callables' return types, then the fields of the records among them
        obj = pending.pop()
        if obj in seen:
            continue
        seen.add(obj)
        hints = typing.get_type_hints(obj.__init__ if isinstance(obj, type) else obj)
        found = _package_classes(hints.get("return"))
        if dataclasses.is_dataclass(obj):
            for hint in typing.get_type_hints(obj).values():
                found |= _package_classes(hint)
        returned |= found
        pending += found
    assert {fp4_inductor.Report, fp4_inductor.SiteRecord, fp4_inductor.TuneResult} <= returned
    assert returned <= exported, f"returned but not in __all__: {returned - exported}"


def test_explain_returns_the_exported_records():
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))

    def model(q, k, v):
        return fp4_inductor.scaled_dot_product_attention(q, k, v, is_causal=True)

    report = fp4_inductor.explain(model, q, k, v, eager=True)
    assert type(report) is fp4_inductor.Report
    assert len(report.sites) == 1 and type(report.sites[0]) is fp4_inductor.SiteRecord


def test_one_version_source():
    pyprojecttoml = pytest.importorskip("setuptools.config.pyprojecttoml")
    project = pyprojecttoml.read_configuration(Path(__file__).parents[1] / "pyproject.toml")["project"]
    assert project["version"] == fp4_inductor.__version__
