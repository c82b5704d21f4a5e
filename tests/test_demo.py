"""examples/demo.py OUT_DIR: the demo removes only what it wrote there (docs/reliability.md's promise)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def demo(monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location("demo", REPO / "examples" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    class Built(Exception):
        pass

    def stop(out: Path) -> None:  # the demo got as far as building its model: stop it there
        raise Built(out)

    monkeypatch.setattr(module, "build_model", stop)
    module.Built = Built
    return module


def test_an_out_dir_holding_a_users_file_is_refused_untouched(demo, tmp_path: Path, capsys):
    out = tmp_path / "out"
    (out / "notes").mkdir(parents=True)
    (out / "notes" / "mine.txt").write_text("a user's file")
    assert demo.main(out) == 1
    assert (out / "notes" / "mine.txt").read_text() == "a user's file"
    assert sorted(p.name for p in out.iterdir()) == ["notes"]
    assert capsys.readouterr().err == (f"demo: error: {out}: holds 'notes/', which the demo did not write; choose "
                                       "another OUT_DIR (the demo removes only its own earlier output)\n")


def test_a_rerun_replaces_the_demos_own_output_only(demo, tmp_path: Path):
    out = tmp_path / "out"
    with pytest.raises(demo.Built):
        demo.main(out)  # a fresh OUT_DIR: the demo's
    (out / "nxd").mkdir()
    (out / "nxd" / "shard.pt").write_text("an earlier run's")
    (out / "curves.png").write_text("an earlier run's")
    with pytest.raises(demo.Built):
        demo.main(out)  # its own earlier output goes, the rerun proceeds
    assert not (out / "nxd").exists() and not (out / "curves.png").exists()
    (out / "todo.txt").write_text("added by the user since")
    assert demo.main(out) == 1
    assert (out / "todo.txt").exists()


def test_a_file_as_out_dir_is_refused(demo, tmp_path: Path):
    (tmp_path / "file").write_text("x")
    assert demo.main(tmp_path / "file") == 1
    assert (tmp_path / "file").read_text() == "x"
