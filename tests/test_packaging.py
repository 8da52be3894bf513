"""What the wheel ships: ``import optclip`` works without flax (the Flax demo lives in
``examples/``), and the demo runs end to end on a tiny configuration."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEMO = ROOT / "examples" / "char_transformer_demo.py"

BLOCK_FLAX = """
import importlib.abc, sys

class BlockFlax(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "flax" or name.startswith("flax."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None

sys.meta_path.insert(0, BlockFlax())
try:
    import flax  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("the blocker did not block flax")
import optax, jax.numpy as jnp, optclip
tx = optax.chain(optclip.zclip(), optclip.clip_by_global_norm(1.0))
state = tx.init({"w": jnp.ones(3)})
_, state = tx.update({"w": jnp.ones(3)}, state)
assert "zclip/norm" in optclip.stats(state)
assert not any(m == "flax" or m.startswith("flax.") for m in sys.modules), "flax was imported"
print("ok")
"""


def test_the_declared_python_is_one_every_floor_version_installs_on():
    """``requires-python`` may not admit a Python on which the oldest versions of the
    dependencies (``.ci/floor.txt``, the floors ``pyproject.toml`` declares) do not install:
    pip would accept optclip there and then fail on jax. Read from the metadata of the
    packages installed at their floor version, so it is checked in the floor run of
    ``make test``."""
    import importlib.metadata
    import tomllib

    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    ours = SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())
                        ["project"]["requires-python"])
    declared = max(Version(spec.version) for spec in ours if spec.operator == ">=")
    pins = dict(line.split("==") for line in (ROOT / ".ci" / "floor.txt").read_text().split()
                if "==" in line)
    checked = []
    for name, version in pins.items():
        try:
            if importlib.metadata.version(name) != version:
                continue
        except importlib.metadata.PackageNotFoundError:
            continue
        theirs = importlib.metadata.metadata(name).get("Requires-Python")
        if theirs:
            assert SpecifierSet(theirs).contains(declared), (
                f"requires-python admits Python {declared}, but {name} {version} (a floor in "
                f".ci/floor.txt) needs {theirs}")
        checked.append(name)
    if not checked:
        pytest.skip("no dependency is installed at its floor version: checked by the floor "
                    "run of make test")


def test_import_without_flax():
    done = subprocess.run([sys.executable, "-c", BLOCK_FLAX], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")


def test_package_has_no_flax_code():
    """No module of the package imports flax at top level (the wheel ships ``optclip/`` only)."""
    offenders = [p.relative_to(ROOT).as_posix() for p in (ROOT / "optclip").rglob("*.py")
                 if any(line.startswith(("import flax", "from flax"))
                        for line in p.read_text().splitlines())]
    assert offenders == []


def _load_demo():
    spec = importlib.util.spec_from_file_location("char_transformer_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_demo_smoke(tmp_path):
    pytest.importorskip("matplotlib", reason="the [demo] extra installs matplotlib")
    demo = _load_demo()
    rows = demo.main(["--steps", "12", "--seeds", "0,1", "--strategies",
                      "none,clip_by_global_norm", "--out", str(tmp_path), "--no-progress",
                      "--batch-size", "2", "--seq-len", "8", "--width", "8", "--depth", "1",
                      "--bad-batches", "6", "--warmup-steps", "2"])
    assert set(rows) == {"none", "clip_by_global_norm"}
    assert rows["none"]["final_loss"].shape == (2,)  # one number per seed
    for name in ("curves.png", "results.md", "results.json", "stats.jsonl"):
        assert (tmp_path / name).stat().st_size > 0
    lines = [json.loads(line) for line in (tmp_path / "stats.jsonl").read_text().splitlines()]
    assert len(lines) == 12 * 2 * len(rows)
    assert {line["seed"] for line in lines} == {0, 1}
    assert any("clip_by_global_norm/norm" in line for line in lines)
    # Seeds differ; every strategy starts from the same weights per seed (same first loss).
    first = {(r["strategy"], r["seed"]): r["loss"] for r in lines if r["step"] == 1}
    assert first["none", 0] == first["clip_by_global_norm", 0] != first["none", 1]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["bigram_baseline"] > 0


def test_demo_help_documents_every_flag():
    actions = _load_demo().build_parser()._actions
    assert {"--seeds", "--steps", "--strategies", "--bad-batches"} <= {
        flag for a in actions for flag in a.option_strings}
    assert [a.option_strings for a in actions if not a.help] == []
    shown = subprocess.run([sys.executable, str(DEMO), "--help"], capture_output=True,
                           text=True, timeout=120, cwd=ROOT)
    assert shown.returncode == 0, shown.stderr
    assert "--seeds" in shown.stdout


def test_bigram_baseline_matches_a_direct_count():
    demo = _load_demo()
    codes = np.frombuffer(b"abababac", np.uint8)
    # pairs: ab x3, ba x3, ac x1: a -> b 3/4, a -> c 1/4; b -> a always.
    want = -(3 * np.log(3 / 4) + np.log(1 / 4)) / 7
    assert abs(demo.bigram_loss(codes) - want) < 1e-12
