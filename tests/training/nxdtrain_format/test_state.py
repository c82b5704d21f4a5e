"""Optimizer state moves with the plan: moments built to equal (a function of) the weights land exactly where the
weights land; ZeRO-1 partitions as torch's ZeroRedundancyOptimizer does; format-1 files map to names or are refused."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import pytest
import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from ckptconv.commands.api import RunOptions, reshard, to_nxd
from ckptconv.core.layout import Attention, ParallelLayout, parse_shard_name
from ckptconv.core.plan import Plan, Source, plan_reshard, plan_to_hf
from ckptconv.engine.execute import ExecOptions, read_tensor, run_plan
from ckptconv.errors import ConversionError, VerificationError
from ckptconv.io.nxd_read import load_shard
from ckptconv.io.nxd_write import TorchZipSink
from ckptconv.sources.nxd import open_nxd
from ckptconv.training.nxdtrain_format.state import (
    FORMAT,
    TagOptimizer,
    TagReader,
    component_source,
    neutral_from_format1,
    plan_optimizer_files,
    stage_groups,
    state_key,
    state_replicas,
    state_tensors,
    zero1_partition,
)
from ckptconv.training.tag_reshard import TrainingTag
from tests.conftest import hf_state, make_tiny_llama


def _moments(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Distinct functions of the weight, so a moment read from the wrong place (or of the wrong component) shows."""
    w = weight.float()
    return {"exp_avg": 2 * w + 1, "exp_avg_sq": w * w + 3, "step": torch.tensor(5.0)}


def _fake_tag(root: Path) -> None:
    """Format-2 optimizer files beside converted shards (one per shard, no ZeRO-1), moments from the weights."""
    (root / "optim").mkdir()
    for shard in sorted((root / "model").iterdir()):
        state = load_shard(shard)
        flat: dict[str, object] = {"format": FORMAT, "names": [k for k in state if not k.endswith("inv_freq")],
                                   "zero1": False, "zero_size": 1, "dp_rank": 0,
                                   "param_groups": [{"lr": 1e-3, "weight_decay": 0.1}, {"lr": 1e-3, "weight_decay": 0.0}]}
        flat["owned"] = flat["names"]
        for key, value in state.items():
            for component, tensor in _moments(value).items():
                flat[state_key(key, component)] = tensor
        torch.save(flat, root / "optim" / shard.name)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GQA model (1 K/V head) at tp 2 with kv_size_multiplier 2 (replicated K/V heads), pp 2, fused QKV."""
    root = tmp_path_factory.mktemp("training-state")
    hf = make_tiny_llama(root / "hf", kv_heads=1, layers=3)
    out = root / "nxd"
    to_nxd(hf, out, tp=2, pp=2, attention="qkv_linear", kv_size_multiplier=2, fuse_qkv=True,
           options=RunOptions(quiet=True, part=(0, 1)))
    _fake_tag(out)
    return out


def _run(source: Path, out: Path, new: ParallelLayout, *, dp: int, zero1: bool) -> Plan:
    opened = open_nxd(source)
    ckpt, spec, old = opened.ckpt, opened.spec, opened.layout
    with ckpt:
        optim = TagOptimizer(source, spec, old)
        plan = plan_reshard(spec, old, new, ckpt.dtypes())
        full = Plan(plan.files + plan_optimizer_files(plan.files, optim, dp=dp, zero1=zero1),
                    plan.replicas + state_replicas(plan.replicas, optim))
        run_plan(full, TagReader(ckpt, optim), out, TrainingTag.sinks(_torch_sink), ExecOptions(workers=2))
        optim.close()
    return full


def _torch_sink(out_file, tmp):  # type: ignore[no-untyped-def]
    return TorchZipSink(out_file, tmp)


@pytest.mark.parametrize("new,dp,zero1", [
    (ParallelLayout(tp=1, pp=1, attention=Attention.QKV_LINEAR), 2, True),
    (ParallelLayout(tp=4, pp=1, kvm=4, attention=Attention.QKV_LINEAR, fuse_qkv=True), 1, False),
    (ParallelLayout(tp=4, pp=1, kvm=4, attention=Attention.QKV_LINEAR, hw="trn2"), 2, True),
    (ParallelLayout(tp=1, pp=3, attention=Attention.SEPARATE), 3, True),
], ids=["tp1-dp2-zero1", "tp4-kvm4", "trn2-tp4-kvm4-dp2-zero1", "separate-pp3-dp3-zero1"])
def test_moments_map_exactly_like_their_weights(source, tmp_path, new, dp, zero1):
    _run(source, tmp_path, new, dp=dp, zero1=zero1)
    shards = sorted((tmp_path / "model").iterdir())
    assert len(shards) == new.tp * new.pp
    for shard in shards:
        weights = load_shard(shard)
        tp, pp = parse_shard_name(shard.name)  # type: ignore[misc]
        files = [tmp_path / "optim" / f"dp_rank_{d:02d}_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"
                 for d in range(dp if zero1 else 1)]
        states = [torch.load(f, weights_only=True) for f in files]
        owned = [n for s in states for n in s["owned"]]
        params = [k for k in weights if not k.endswith("inv_freq")]
        assert sorted(owned) == sorted(params)  # every parameter's state in exactly one dp rank's file
        merged = {k: v for s in states for k, v in s.items() if k.startswith("state.")}
        for key in params:
            for component, want in _moments(weights[key]).items():
                assert torch.equal(merged[state_key(key, component)], want), (shard.name, key, component)
        assert all(s["param_groups"][1] == {"lr": 1e-3, "weight_decay": 0.0} for s in states)


def test_differing_replica_moments_are_reported(source, tmp_path):
    """K/V replicas (tp 2, kvm 2: both ranks hold K/V head 0) must agree in their moments as in their weights."""
    broken = tmp_path / "src"
    shutil.copytree(source, broken)
    path = broken / "optim/dp_rank_00_tp_rank_01_pp_rank_00.pt"
    state = torch.load(path, weights_only=True)
    key = state_key("model.layers.0.self_attn.qkv_proj.weight_qkv", "exp_avg_sq")
    state[key][-1, 0] += 1.0  # the last row: a V row, replicated on tp rank 0
    torch.save(state, path)
    with pytest.raises(VerificationError, match=r"replicas of model.layers.0.self_attn.v_proj.weight \(exp_avg_sq\)"
                                                r"\[0:8\] differ: .*max abs difference 1"):
        _run(broken, tmp_path / "out", ParallelLayout(tp=1, pp=1), dp=1, zero1=False)


def _torch_partition(sizes: list[list[int]], world: int) -> list[list[list[int]]]:
    """torch's own ZeroRedundancyOptimizer._partition_parameters, run on a stand-in (no process group)."""
    stub = types.SimpleNamespace(world_size=world, _partition_parameters_cache=[],
                                 param_groups=[{"params": [torch.zeros(n) for n in group]} for group in sizes])
    stub._get_min_index = types.MethodType(ZeroRedundancyOptimizer._get_min_index, stub)
    stub._partition_param_group = types.MethodType(ZeroRedundancyOptimizer._partition_param_group, stub)
    result = ZeroRedundancyOptimizer._partition_parameters(stub)
    ids = {id(p): (g, i) for g, group in enumerate(stub.param_groups) for i, p in enumerate(group["params"])}
    return [[[ids[id(p)][1] for p in group["params"]] for group in rank] for rank in result]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zero1_partition_is_torchs(world):
    sizes = [[64, 96, 64, 8, 96, 7, 64], [8, 8, 8, 3]]  # ties, as a Llama stage has them
    ours = zero1_partition([[(str(i), n) for i, n in enumerate(g)] for g in sizes], world)
    assert [[[int(n) for n in group] for group in rank] for rank in ours] == _torch_partition(sizes, world)


def test_format1_maps_positions_to_names():
    """nxdtrain's earlier files: a torch optimizer state_dict by position, read back by name."""
    shapes = {"a.weight": (3, 2), "norm.weight": (2,), "b.weight": (4, 2)}
    names = list(shapes)
    params = {n: torch.nn.Parameter(torch.randn(s)) for n, s in shapes.items()}
    groups = [{"params": [params[n] for n, _ in g], "weight_decay": wd}
              for g, wd in zip(stage_groups(names, shapes), (0.1, 0.0), strict=True)]
    opt = torch.optim.AdamW(groups, lr=1e-3)
    for p in params.values():
        p.grad = torch.randn_like(p)
    opt.step()
    state = {"format": 1, "names": names, "zero1": False, "zero_size": 1, "optimizer": opt.state_dict()}
    neutral = neutral_from_format1(state, shapes, dp_rank=0, where="f.pt")
    for name, p in params.items():
        assert torch.equal(neutral[state_key(name, "exp_avg")], opt.state[p]["exp_avg"])
    assert neutral["param_groups"][1]["weight_decay"] == 0.0 and "params" not in neutral["param_groups"][0]
    with pytest.raises(ConversionError, match=r"^f.pt: state 1 \(exp_avg\) has shape \[4, 2\], parameter 'b.weight' "):
        neutral_from_format1(state, {**shapes, "b.weight": (2, 4)}, dp_rank=0, where="f.pt")


def test_optimizer_file_of_unknown_format_is_refused(source, tmp_path):
    copy = tmp_path / "src"
    shutil.copytree(source, copy)
    path = copy / "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt"
    torch.save({"format": 7}, path)
    opened = open_nxd(copy)
    spec, layout = opened.spec, opened.layout
    with pytest.raises(ConversionError, match=r"dp_rank_00_tp_rank_00_pp_rank_00.pt: optimizer state format 7; this "
                                              r"ckptconv reads formats 1 and 2"):
        TagOptimizer(copy, spec, layout)


def _as_format1(root: Path) -> None:
    """Rewrite the fake tag's files as nxdtrain wrote them before format 2: a torch state_dict by position."""
    open_nxd(root)
    for path in sorted((root / "optim").iterdir()):
        flat = torch.load(path, weights_only=True)
        names = flat["names"]
        shapes = {n: tuple(flat[state_key(n, "exp_avg")].shape) for n in names}
        order = [n for group in stage_groups(names, shapes) for n, _ in group]
        state = {i: {c: flat[state_key(n, c)] for c in ("step", "exp_avg", "exp_avg_sq")} for i, n in enumerate(order)}
        sizes = [len(g) for g in stage_groups(names, shapes)]
        groups = [{**flat["param_groups"][0], "params": list(range(sizes[0]))},
                  {**flat["param_groups"][1], "params": list(range(sizes[0], sizes[0] + sizes[1]))}]
        torch.save({"format": 1, "names": names, "zero1": False, "zero_size": 1,
                    "optimizer": {"state": state, "param_groups": groups}}, path)


def test_format1_tag_reshards_like_format2(source, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(source, old)
    _as_format1(old)
    new = ParallelLayout(tp=1, pp=1, attention=Attention.QKV_LINEAR)
    _run(source, tmp_path / "from2", new, dp=2, zero1=True)
    _run(old, tmp_path / "from1", new, dp=2, zero1=True)
    for name in ("dp_rank_00_tp_rank_00_pp_rank_00.pt", "dp_rank_01_tp_rank_00_pp_rank_00.pt"):
        assert (tmp_path / "from1/optim" / name).read_bytes() == (tmp_path / "from2/optim" / name).read_bytes()


def test_moments_by_hf_name(source):
    """The same records give every HF tensor's moments whole (what a TorchTitan export with optimizer state reads)."""
    opened = open_nxd(source)
    ckpt, spec, layout = opened.ckpt, opened.spec, opened.layout
    with ckpt:
        optim = TagOptimizer(source, spec, layout)
        reader = TagReader(ckpt, optim)
        plan = plan_to_hf(spec, layout, ckpt.dtypes())
        tensors = [t for f in plan.files for t in f.tensors]
        assert {t.key for t in tensors} == set(hf_state(source.parent / "hf"))
        for tensor in tensors:
            weight = read_tensor(tensor, reader)
            moments = {c: read_tensor(t, reader) for c, t in state_tensors(tensor, optim).items()}
            assert moments.keys() == {"step", "exp_avg", "exp_avg_sq"}
            for component, want in _moments(weight).items():
                assert torch.equal(moments[component], want), (tensor.key, component)
        optim.close()


def test_optimizer_sources_report_where_their_bytes_lie(source):
    """The executor reads each file front to back by these positions (so checked reads hash what it reads, not the
    file a second time): every moment's position is where torch's own file holds its storage's bytes."""
    opened = open_nxd(source)
    ckpt, spec, layout = opened.ckpt, opened.spec, opened.layout
    found = 0
    with ckpt:
        optim = TagOptimizer(source, spec, layout)
        reader = TagReader(ckpt, optim)
        for shard in sorted((source / "model").iterdir()):
            data = (source / "optim" / shard.name).read_bytes()
            saved = torch.load(source / "optim" / shard.name, weights_only=True)
            weights = Source(f"model/{shard.name}", "")
            for key in load_shard(shard):
                for component in ("exp_avg", "exp_avg_sq"):
                    tensor = saved[state_key(key, component)]
                    storage = bytes(tensor.untyped_storage())
                    if len(storage) < 64:  # too short to be found in the file unambiguously
                        continue
                    start = data.find(storage)
                    assert start > 0 and data.find(storage, start + 1) < 0, key
                    want = start + tensor.storage_offset() * tensor.element_size()
                    assert reader.position(component_source(Source(weights.file, key), component)) == want, key
                    found += 1
        optim.close()
    assert found > 10


def test_moments_of_a_padded_vocabulary(tmp_path):
    """tp 4 pads a 130-row vocabulary to 132: the padding rows' moments are zeros (as training leaves them), and
    resharding back to tp 1 gives every moment of the source (ckptconv reshard of a training tag, both ways)."""
    hf = make_tiny_llama(tmp_path / "hf", kv_heads=4, layers=2, vocab=130)
    src = tmp_path / "src"
    to_nxd(hf, src, tp=1, options=RunOptions(quiet=True, part=(0, 1)))
    _fake_tag(src)
    torch.save({"step": 5, "consumed_samples": 20, "rng": [], "options": {}}, src / "user_content.pt")
    torch.save({"step": 5}, src / "scheduler.pt")
    unchecked = RunOptions(quiet=True, part=(0, 1), check=False)  # the fake's side files are not in its records
    reshard(src, tmp_path / "tp4", tp=4, pp=1, options=unchecked)
    padded = torch.load(tmp_path / "tp4/optim/dp_rank_00_tp_rank_03_pp_rank_00.pt", weights_only=True)
    rows = padded[state_key("model.embed_tokens.weight", "exp_avg")]
    assert rows.shape[0] == 33 and torch.equal(rows[-2:], torch.zeros_like(rows[-2:]))
    reshard(tmp_path / "tp4", tmp_path / "back", tp=1, pp=1, options=RunOptions(quiet=True, part=(0, 1)))
    want = torch.load(src / "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt", weights_only=True)
    got = torch.load(tmp_path / "back/optim/dp_rank_00_tp_rank_00_pp_rank_00.pt", weights_only=True)
    tensors = [k for k, v in want.items() if isinstance(v, torch.Tensor)]
    assert sorted(tensors) == sorted(k for k, v in got.items() if isinstance(v, torch.Tensor))
    assert all(torch.equal(want[k], got[k]) for k in tensors)
    # What a training rank reads on its own (read_tensor, nxdtrain's resume at tp 4): the same rows.
    opened = open_nxd(src, check=False)
    ckpt, spec, old = opened.ckpt, opened.spec, opened.layout
    with ckpt:
        optim = TagOptimizer(src, spec, old)
        new = ParallelLayout.from_json(json.loads((tmp_path / "tp4/ckptconv.json").read_text())["layout"])
        plan = plan_reshard(spec, old, new, ckpt.dtypes())
        embed = next(t for f in plan.files if f.path.endswith("tp_rank_03_pp_rank_00.pt") for t in f.tensors
                     if t.key == "model.embed_tokens.weight")
        assert torch.equal(read_tensor(state_tensors(embed, optim)["exp_avg"], TagReader(ckpt, optim)), rows)
        optim.close()
