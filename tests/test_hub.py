"""Hub ids (org/name --revision) resolved from a local Hugging Face cache, offline; to-hf --push-to-hub."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants, scan_cache_dir

from ckptconv.cli.main import main
from ckptconv.errors import ConversionError
from ckptconv.sources.hub import is_hub_id, resolve_hf

REPO_ID = "acme/tiny-llama"
MAIN, V1 = "a" * 40, "b" * 40  # commit hashes of the two cached revisions


def add_snapshot(cache: Path, repo_id: str, model: Path, commit: str, refs: tuple[str, ...]) -> Path:
    """Put ``model``'s files into ``cache`` the way huggingface_hub stores a download.

    ``models--org--name/blobs/<sha256>`` holds the bytes, ``snapshots/<commit>/<file>`` links to the blob,
    ``refs/<ref>`` holds the commit hash.
    """
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    for file in sorted(model.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, tiny_models, monkeypatch):
    """A cache with acme/tiny-llama: main -> model A, tag v1 -> model B (another seed); offline."""
    cache = tmp_path / "hf-home" / "hub"
    model_a = tiny_models("hub-a", heads=8, kv_heads=2, head_dim=8, layers=2, seed=1)
    model_b = tiny_models("hub-b", heads=8, kv_heads=2, head_dim=8, layers=2, seed=2)
    add_snapshot(cache, REPO_ID, model_a, MAIN, ("main",))
    add_snapshot(cache, REPO_ID, model_b, V1, ("v1",))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the environment once, at import: set what it read for this process too.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache, model_a, model_b


def tree(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def assert_same_conversion(a: Path, b: Path) -> None:
    """Every file byte-identical, except ckptconv.json's fingerprint (it names the input paths)."""
    files_a, files_b = tree(a), tree(b)
    meta_a, meta_b = (json.loads(files.pop("ckptconv.json")) for files in (files_a, files_b))
    assert files_a == files_b
    assert meta_a.pop("fingerprint") != meta_b.pop("fingerprint")
    assert meta_a == meta_b


def test_docstring_examples():
    import doctest

    import ckptconv.sources.hub

    result = doctest.testmod(ckptconv.sources.hub)
    assert result.attempted > 0 and result.failed == 0


def test_cache_layout_is_huggingface_hubs(hub_cache):
    cache, _, _ = hub_cache
    info = scan_cache_dir(cache)
    assert info.warnings == []
    (repo,) = info.repos
    assert (repo.repo_id, repo.repo_type) == (REPO_ID, "model")
    assert {rev.commit_hash: sorted(rev.refs) for rev in repo.revisions} == {MAIN: ["main"], V1: ["v1"]}
    assert sorted(f.file_name for f in next(iter(repo.revisions)).files) == ["config.json", "generation_config.json",
                                                                           "model.safetensors"]


def test_resolution_order(hub_cache, tmp_path, monkeypatch):
    cache, model_a, model_b = hub_cache
    assert resolve_hf(REPO_ID) == cache / "models--acme--tiny-llama/snapshots" / MAIN
    assert resolve_hf(REPO_ID, revision="v1") == cache / "models--acme--tiny-llama/snapshots" / V1
    assert resolve_hf(REPO_ID, revision=V1) == cache / "models--acme--tiny-llama/snapshots" / V1
    assert resolve_hf("no/such/model") == Path("no/such/model")  # not an id: the caller's "no such file" error
    # An existing local path always wins over a hub id of the same spelling.
    monkeypatch.chdir(tmp_path)
    shutil.copytree(model_b, tmp_path / REPO_ID)
    assert resolve_hf(REPO_ID) == Path(REPO_ID)
    assert [is_hub_id(s) for s in ("org/name", "Org-1/na.me_2", "./x", "a/b/c", "name", "a--b/c", "a/..b", "/abs/p")] == [
        True, True, False, False, False, False, False, False]


def test_to_nxd_from_hub_id_with_revision(hub_cache, tmp_path, capsys):
    """`to-nxd org/name --revision v1` converts the v1 snapshot: the same bytes as converting that model's dir."""
    cache, model_a, model_b = hub_cache
    flags = ["--tp", "2", "--qkv-linear", "--fuse-qkv", "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = subprocess.run([sys.executable, "-m", "ckptconv.cli", "to-nxd", REPO_ID, str(tmp_path / "from-hub"),
                          "--revision", "v1", *flags], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert main(["to-nxd", str(model_b), str(tmp_path / "from-dir"), *flags]) == 0
    assert_same_conversion(tmp_path / "from-hub", tmp_path / "from-dir")
    # Without --revision: main, which is model A.
    assert main(["to-nxd", REPO_ID, str(tmp_path / "main"), *flags]) == 0
    assert main(["to-nxd", str(model_a), str(tmp_path / "a-dir"), *flags]) == 0
    assert_same_conversion(tmp_path / "main", tmp_path / "a-dir")
    assert tree(tmp_path / "main")["model/dp_rank_00_tp_rank_00_pp_rank_00.pt"] != tree(
        tmp_path / "from-hub")["model/dp_rank_00_tp_rank_00_pp_rank_00.pt"]


def test_verify_and_inspect_take_hub_ids(hub_cache, tmp_path, capsys):
    cache, _, model_b = hub_cache
    assert main(["to-nxd", str(model_b), str(tmp_path / "nxd"), "--tp", "2", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["verify", REPO_ID, str(tmp_path / "nxd"), "--revision", "v1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert main(["verify", REPO_ID, str(tmp_path / "nxd"), "--json"]) == 1  # main is another model
    capsys.readouterr()
    assert main(["inspect", REPO_ID, "--revision", "v1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == str(cache / "models--acme--tiny-llama/snapshots" / V1)


def test_missing_hub_id_and_misused_revision_are_one_line_errors(hub_cache, tmp_path, tiny_models, capsys):
    cache, model_a, _ = hub_cache
    assert main(["to-nxd", "acme/missing", str(tmp_path / "out"), "--tp", "1", "--quiet"]) == 1
    assert capsys.readouterr().err == (
        f"ckptconv: error: SRC acme/missing: no such local path, and hub model 'acme/missing' (revision main) is not "
        f"in the Hugging Face cache {cache}; HF_HUB_OFFLINE is set, so nothing was downloaded\n")
    assert main(["to-nxd", REPO_ID, str(tmp_path / "out"), "--tp", "1", "--revision", "v2", "--quiet"]) == 1
    assert "hub model 'acme/tiny-llama' (revision v2) is not in the Hugging Face cache" in capsys.readouterr().err
    assert main(["to-nxd", str(model_a), str(tmp_path / "out"), "--tp", "1", "--revision", "v1", "--quiet"]) == 1
    assert capsys.readouterr().err == (f"ckptconv: error: --revision v1: SRC {model_a} is a local path; "
                                       "--revision is for hub ids (org/name)\n")
    assert not (tmp_path / "out").exists()


class FakeHfApi:
    """Stands in for huggingface_hub.HfApi (the network is unreachable): records every call."""

    calls: list[tuple[str, tuple, dict]] = []

    def create_repo(self, *args, **kwargs):
        self.calls.append(("create_repo", args, kwargs))
        return f"https://huggingface.co/{args[0]}"

    def upload_folder(self, *args, **kwargs):
        self.calls.append(("upload_folder", args, kwargs))
        return type("CommitInfo", (), {"oid": "c" * 40, "commit_url": "https://huggingface.co/acme/x/commit/ccc"})()


def test_to_hf_push_to_hub(tmp_path, tiny_models, monkeypatch, capsys):
    model = tiny_models("hub-a", heads=8, kv_heads=2, head_dim=8, layers=2, seed=1)
    assert main(["to-nxd", str(model), str(tmp_path / "nxd"), "--tp", "2", "--quiet"]) == 0
    FakeHfApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHfApi)
    out = tmp_path / "hf"
    capsys.readouterr()
    assert main(["to-hf", str(tmp_path / "nxd"), str(out), "--push-to-hub", "acme/tiny-trained", "--private",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    files = sorted(p.name for p in out.iterdir())
    assert files == ["ckptconv.json", "config.json", "generation_config.json", "model.safetensors"]
    assert FakeHfApi.calls == [
        ("create_repo", ("acme/tiny-trained",), {"private": True, "repo_type": "model", "exist_ok": True}),
        ("upload_folder", (), {"repo_id": "acme/tiny-trained", "folder_path": str(out), "repo_type": "model",
                               "revision": None, "commit_message": "Upload hf (ckptconv to-hf)",
                               "ignore_patterns": [".*"]}),
    ]
    assert result["pushed"] == {"repo": "acme/tiny-trained", "url": "https://huggingface.co/acme/tiny-trained",
                                "private": True, "revision": "main", "commit": "c" * 40,
                                "commit_url": "https://huggingface.co/acme/x/commit/ccc", "files": files}
    # A failed export pushes nothing; --private alone is refused.
    FakeHfApi.calls = []
    (tmp_path / "other").mkdir()
    (tmp_path / "other/notes.txt").write_text("not ours")
    assert main(["to-hf", str(tmp_path / "nxd"), str(tmp_path / "other"), "--push-to-hub", "acme/x", "--quiet"]) == 1
    assert main(["to-hf", str(tmp_path / "nxd"), str(tmp_path / "hf2"), "--private", "--quiet"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == "ckptconv: error: --private needs --push-to-hub ORG/NAME"
    assert FakeHfApi.calls == []


def test_download_only_when_not_cached_and_online(tmp_path, monkeypatch):
    """Online (HF_HUB_OFFLINE unset) and not cached: one download of the files a conversion reads; its failure is
    one line. snapshot_download stands in for the network, which is unreachable here."""
    import huggingface_hub.errors

    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        if kwargs.get("local_files_only"):
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        if repo_id == "acme/down":
            raise OSError("Connection refused\nmore detail")
        return str(tmp_path / "snapshot")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    assert resolve_hf("acme/up", revision="v2") == tmp_path / "snapshot"
    patterns = ["*.json", "*.safetensors", "tokenizer.model", "merges.txt", "chat_template.jinja"]
    assert calls == [("acme/up", {"revision": "v2", "local_files_only": True, "allow_patterns": patterns}),
                     ("acme/up", {"revision": "v2", "allow_patterns": patterns})]
    with pytest.raises(ConversionError) as info:
        resolve_hf("acme/down")
    assert str(info.value) == (f"SRC acme/down: no such local path, and hub model 'acme/down' (revision main) is not "
                               f"in the Hugging Face cache {tmp_path / 'cache'}, and the download failed: "
                               "Connection refused")
