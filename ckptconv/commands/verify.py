"""``ckptconv verify``: prove that NxD shards compute what the HF model computes.

For each checked layer the same random hidden states go through (a) the dense layer built from
the HF weights and (b) the layer as the tp ranks compute it from their shards: each rank's own
Q/K/V rows, attention over the K/V heads it holds (local grouping, as the runtime does), its
partial ``o_proj`` and ``down_proj`` products summed (the all-reduce), ``gate_up`` split per
rank. Then the vocab-parallel embedding lookup and the ``lm_head`` logits. A head paired with
the wrong K/V head, a fused QKV split at the wrong place, a column block from another rank or a
norm from another layer all change (b) and are reported with the layer, component and ranks.

A training tag that was trained (its ``ckptconv.json`` records step 1 or later) holds other weights than the HF model
it started from: against that model verify says so first and blames no rank; against the tag's own export (which
records the tag it came from) it checks the shards as usual.

Example:
    >>> report = verify("llama-hf", "llama-nxd", layers=2)   # doctest: +SKIP
    >>> report["ok"]                                          # doctest: +SKIP
    True
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckptconv.commands.inspect_dcp import is_dcp
from ckptconv.commands.steps import EXPORTED_FROM, trained_record
from ckptconv.commands.verify_checks import Check
from ckptconv.commands.verify_checks import as_json as _as_json
from ckptconv.commands.verify_checks import close as _close
from ckptconv.commands.verify_checks import compare as _compare
from ckptconv.commands.verify_checks import default_tol as _default_tol
from ckptconv.commands.verify_checks import hf_layer as _hf_layer
from ckptconv.commands.verify_checks import problem as _problem
from ckptconv.commands.verify_checks import sample_layers as _sample_layers
from ckptconv.commands.verify_dcp import verify_dcp
from ckptconv.commands.verify_moe import check_sparse_mlp, dense_sparse_mlp
from ckptconv.core.layout import Attention, ParallelLayout, layer_pp_ranks
from ckptconv.core.mapping import EMBED, FINAL_NORM, LM_HEAD, kv_heads, q_heads, stores_lm_head
from ckptconv.core.model_spec import ModelSpec
from ckptconv.core.plan import Source
from ckptconv.core.reference import (
    attention_heads,
    dense_layer,
    layer_attention_extras,
    mlp,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
)
from ckptconv.engine.finalize import refuse_unfinished
from ckptconv.engine.progress import byte_progress
from ckptconv.errors import ConversionError
from ckptconv.io.digest import FileRecord
from ckptconv.io.hf import HfCheckpoint
from ckptconv.io.metadata import read_metadata
from ckptconv.io.nxd_read import NxdCheckpoint
from ckptconv.sources.nxd import open_nxd

# When the shards were cast (e.g. fp32 HF -> bf16 shards) the weights themselves differ by the cast.


class _Shards:
    """One layer's weights as each tp rank holds them, split the way the runtime splits them."""

    def __init__(self, ckpt: NxdCheckpoint, spec: ModelSpec, layout: ParallelLayout) -> None:
        self.ckpt, self.spec, self.layout = ckpt, spec, layout
        self.pp_of_layer = layer_pp_ranks(spec.layers, layout)

    def file(self, tp: int, pp: int) -> str:
        return self.ckpt.file_of(tp_rank=tp, pp_rank=pp)

    def tensor(self, file: str, key: str) -> torch.Tensor:
        if key not in self.ckpt.keys(file):
            raise ConversionError(f"{self.ckpt.files[file]}: missing {key!r}")
        _, shape, _ = self.ckpt.info(Source(file, key))
        rows = shape[0] if shape else 1
        return self.ckpt.read_rows(Source(file, key), 0, rows).reshape(shape).float()

    def layer(self, layer: int, rank: int) -> dict[str, torch.Tensor]:
        file = self.file(rank, self.pp_of_layer[layer])
        prefix = f"model.layers.{layer}."
        t = lambda name: self.tensor(file, prefix + name)  # noqa: E731
        n_rows = self.spec.heads // self.layout.tp * self.spec.head_dim
        w = self._qkv(t, n_rows, "weight")
        if self.spec.family.qkv_bias:
            # The optional attention inputs under their HF names, as reference.layer_attention_extras reads them.
            w.update({f"self_attn.{part}_proj.bias": value for part, value in self._qkv(t, n_rows, "bias").items()})
        if self.spec.family.qk_norm:
            w.update({name: t(name) for name in ("self_attn.q_norm.weight", "self_attn.k_norm.weight")})
        if w["q"].shape[0] != n_rows:
            raise ConversionError(
                f"{self.ckpt.files[file]}: layer {layer} holds {w['q'].shape[0]} Q rows on rank {rank}, "
                f"{self.spec.heads} heads / tp {self.layout.tp} x head_dim {self.spec.head_dim} = {n_rows} expected"
            )
        w["o"] = t("self_attn.o_proj.weight")
        if not self.spec.sparse(layer):  # a sparse layer's experts: verify_moe, rank by rank
            w["gate"], w["up"] = t("mlp.gate_up_proj.weight").chunk(2)
            w["down"] = t("mlp.down_proj.weight")
        w["ln1"], w["ln2"] = t("input_layernorm.weight"), t("post_attention_layernorm.weight")
        return w

    def _qkv(self, t: Callable[[str], torch.Tensor], n_rows: int, kind: str) -> dict[str, torch.Tensor]:
        """q/k/v weights (``kind`` weight) or biases (bias) of one rank, split as the runtime splits them."""
        w: dict[str, torch.Tensor] = {}
        if self.layout.attention is Attention.QKV_LINEAR and self.layout.fuse_qkv:
            qkv = t(f"self_attn.qkv_proj.{kind}_qkv")
            kv_rows = (qkv.shape[0] - n_rows) // 2  # the runtime splits by head counts
            w["q"], w["k"], w["v"] = qkv.split([n_rows, kv_rows, kv_rows])
        elif self.layout.attention is Attention.QKV_LINEAR:
            w["q"], w["k"], w["v"] = (t(f"self_attn.qkv_proj.{kind}_{p}") for p in "qkv")
        elif self.layout.attention is Attention.COALESCED:
            w["q"], w["k"], w["v"] = t(f"self_attn.qkv_proj.{kind}").chunk(3)
        else:
            w["q"], w["k"], w["v"] = (t(f"self_attn.{p}_proj.{kind}") for p in "qkv")
        return w


def _check_layer(x: torch.Tensor, hf_w: dict[str, torch.Tensor], shards: _Shards, layer: int, tol: float) -> list[Check]:
    spec, layout = shards.spec, shards.layout
    config, hd = spec.config, spec.head_dim
    eps = float(config.get("rms_norm_eps", 1e-6))
    window = spec.window
    sparse = spec.sparse(layer)
    dense = dense_layer(x, hf_w, config, hd, window=window, mlp_of=dense_sparse_mlp(spec, hf_w) if sparse else None)
    cos, sin = rope_cos_sin(rope_inv_freq(config, hd), x.shape[1])
    h = rms_norm(x, hf_w["input_layernorm.weight"], eps)
    dense_heads = attention_heads(h, hf_w["self_attn.q_proj.weight"], hf_w["self_attn.k_proj.weight"],
                                  hf_w["self_attn.v_proj.weight"], hd, cos, sin, window=window,
                                  **layer_attention_extras(hf_w, eps)).view(*x.shape[:2], spec.heads, hd)
    x1 = x + dense["attention"]
    h2 = rms_norm(x1, hf_w["post_attention_layernorm.weight"], eps)
    attn_sum = torch.zeros_like(x)
    mlp_sum = torch.zeros_like(x)
    bad: dict[str, list[int]] = {"attention": [], "o_proj": [], "biases": [], "mlp": [], "norms": []}
    chunk = spec.intermediate // layout.tp
    h2_of_rank = []
    for rank in range(layout.tp):
        w = shards.layer(layer, rank)
        if not (_close(w["ln1"], hf_w["input_layernorm.weight"], tol) and _close(w["ln2"], hf_w["post_attention_layernorm.weight"], tol)):
            bad["norms"].append(rank)
        if "self_attn.q_norm.weight" in w and not all(_close(w[n], hf_w[n], tol) for n in
                                                      ("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            bad["norms"].append(rank)
        h_r = rms_norm(x, w["ln1"], eps)
        attn_r = attention_heads(h_r, w["q"], w["k"], w["v"], hd, cos, sin, window=window, **layer_attention_extras(w, eps))
        attn_sum += attn_r @ w["o"].t()
        # Diagnose against the heads this layout says the rank holds.
        heads = _claimed_q_heads(spec, layout, rank)
        head_rows = _claimed_rows(spec, layout, rank)
        if "self_attn.q_proj.bias" in w and not all(_close(w[f"self_attn.{p}_proj.bias"], hf_w[f"self_attn.{p}_proj.bias"][r],
                                                           tol) for p, r in head_rows.items()):
            bad["biases"].append(rank)
        expected_attn = dense_heads[:, :, heads].reshape(*x.shape[:2], -1)
        if not _close(attn_r, expected_attn, tol):
            bad["attention"].append(rank)
        if not _close(w["o"], hf_w["self_attn.o_proj.weight"][:, head_rows["q"]], tol):  # o_proj's columns: the q rows
            bad["o_proj"].append(rank)
        h2_r = rms_norm(x1, w["ln2"], eps)
        h2_of_rank.append(h2_r)
        if sparse:
            continue
        m_r = mlp(h2_r, w["gate"], w["up"], w["down"])
        mlp_sum += m_r
        rows = slice(rank * chunk, (rank + 1) * chunk)
        expected_m = mlp(h2, hf_w["mlp.gate_proj.weight"][rows], hf_w["mlp.up_proj.weight"][rows],
                         hf_w["mlp.down_proj.weight"][:, rows])
        if not _close(m_r, expected_m, tol):
            bad["mlp"].append(rank)
    mlp_detail = _blame(bad, ("mlp", "gate_up/down blocks"))
    if sparse:
        mlp_sum, bad["mlp"], mlp_detail = check_sparse_mlp(shards, layer, h2, h2_of_rank, hf_w,
                                                           lambda a, b: _close(a, b, tol))
    checks = [
        _compare("attention", attn_sum, dense["attention"]),
        _compare("mlp", mlp_sum, dense["mlp"]),
        _compare("output", x + attn_sum + mlp_sum, dense["output"]),
    ]
    checks[0].ranks = sorted(set(bad["attention"]) | set(bad["o_proj"]) | set(bad["biases"]))
    checks[0].detail = _blame(bad, ("attention", "Q/K/V heads"), ("biases", "q/k/v biases"),
                              ("o_proj", "o_proj columns"), ("norms", "norm weights"))
    checks[1].ranks = bad["mlp"]
    checks[1].detail = mlp_detail
    if bad["norms"]:
        checks.append(Check("norms", 0.0, 0.0, ranks=bad["norms"], detail=_blame(bad, ("norms", "norm weights"))))
    return checks


def _claimed_q_heads(spec: ModelSpec, layout: ParallelLayout, rank: int) -> list[int]:
    if layout.attention is Attention.QKV_LINEAR:
        return q_heads(spec, layout, rank)
    n = spec.heads // layout.tp
    return list(range(rank * n, (rank + 1) * n))


def _claimed_kv_heads(spec: ModelSpec, layout: ParallelLayout, rank: int) -> list[int]:
    if layout.attention is Attention.QKV_LINEAR:
        return kv_heads(spec, layout, rank)
    n = spec.kv_heads // layout.tp if layout.attention is Attention.SEPARATE else spec.heads // layout.tp
    return list(range(rank * n, (rank + 1) * n))


def _claimed_rows(spec: ModelSpec, layout: ParallelLayout, rank: int) -> dict[str, torch.Tensor]:
    """The HF rows of q, k and v (q's are o_proj's columns too) of the heads the layout says ``rank`` holds."""
    def rows(heads: list[int]) -> torch.Tensor:
        return torch.cat([torch.arange(h * spec.head_dim, (h + 1) * spec.head_dim) for h in heads])

    kv = rows(_claimed_kv_heads(spec, layout, rank))
    return {"q": rows(_claimed_q_heads(spec, layout, rank)), "k": kv, "v": kv}


def _blame(bad: dict[str, list[int]], *parts: tuple[str, str]) -> str:
    return "; ".join(f"{label} differ on rank(s) {', '.join(map(str, bad[k]))}" for k, label in parts if bad[k])


def _check_vocab(hf: HfCheckpoint, shards: _Shards, generator: torch.Generator) -> list[Check]:
    spec, layout = shards.spec, shards.layout
    eps = float(spec.config.get("rms_norm_eps", 1e-6))
    full = lambda key: hf.read_rows(Source(None, key), 0, hf.info(Source(None, key))[1][0]).float()  # noqa: E731
    embed = full(EMBED)
    ids = torch.randint(0, spec.vocab, (2, 16), generator=generator)
    per = layout.vocab_rows(spec) // layout.tp  # padding rows (if any) are never looked up
    lookup = torch.zeros(2, 16, spec.hidden)
    for rank in range(layout.tp):
        local = shards.tensor(shards.file(rank, 0), EMBED)
        mask = (ids >= rank * per) & (ids < (rank + 1) * per)
        lookup += local[(ids - rank * per).clamp(0, per - 1)] * mask.unsqueeze(-1)
    checks = [_compare("embedding", lookup, embed[ids])]
    x = torch.randn(2, 16, spec.hidden, generator=generator)
    head = embed if spec.tied else full(LM_HEAD)
    expected = rms_norm(x, full(FINAL_NORM), eps) @ head.t()
    last = layout.pp - 1
    # A tied model's shards without lm_head.weight (the official converter's) project with the embedding.
    head_of = {r: (shards.file(r, last), LM_HEAD) for r in range(layout.tp)}
    if not stores_lm_head(spec, shards.ckpt.keys(shards.file(0, last))):
        head_of = {r: (shards.file(r, 0), EMBED) for r in range(layout.tp)}
    logits = torch.cat(
        [rms_norm(x, shards.tensor(shards.file(r, last), FINAL_NORM), eps) @ shards.tensor(*head_of[r]).t()
         for r in range(layout.tp)], dim=-1)[..., :spec.vocab]  # padding logits are masked wherever used
    checks.append(_compare("lm_head", logits, expected))
    return checks


def verify(
    hf_dir: str | Path,
    nxd_dir: str | Path,
    *,
    layers: int | str = "all",
    tol: float | None = None,
    seed: int = 0,
    config: str | Path | None = None,
    hints: dict[str, Any] | None = None,
    files: bool = False,
    revision: str | None = None,
    check: bool = True,
    masters: bool | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Compare the sharded computation with the dense HF one; see the module docstring.

    ``masters=True``: check the fp32 master weights in the tag's ``optim/`` instead of the shards (see
    :func:`ckptconv.sources.nxd.open_nxd`; NxD's are read without asking when the model files hold none).

    ``hf_dir`` may be a hub id ``org/name`` (``revision``: branch, tag or commit), see :mod:`ckptconv.sources.hub`.

    ``tol`` defaults to 1e-4 relative, looser when the shards hold a lower precision than the HF
    weights (a cast, e.g. ``--dtype bf16``). With ``check`` every shard read from is checked
    against its record (size, digest, zip CRC-32s; IntegrityError on a mismatch). ``progress``: a bar of the
    layers checked on stderr.

    A trained tag checked against another HF model than its own export: ``trained`` in the result (its steps and
    what to compare it with instead), that first among the notes, no rank blamed, and one problem saying so.
    """
    from ckptconv.sources.hub import resolve_hf

    hf_dir = resolve_hf(hf_dir, revision=revision, flag="HF_DIR")
    refuse_unfinished(hf_dir)  # an interrupted export (the shards: open_nxd says the same)
    if is_dcp(Path(nxd_dir)):  # a DCP directory or TorchTitan root: TorchTitan's layout, checked the same way
        return verify_dcp(hf_dir, nxd_dir, layers=layers, tol=tol, seed=seed, config=config, check=check,
                          progress=progress)
    opened = open_nxd(nxd_dir, config=config, hints=hints, check=check, masters=masters)
    ckpt, spec, layout, notes = opened.ckpt, opened.spec, opened.layout, opened.notes
    generator = torch.Generator().manual_seed(seed)
    results: dict[str, Any] = {"layers": {}, "notes": notes}
    problems: list[str] = []
    trained = _trained_elsewhere(ckpt.metadata, hf_dir)
    blame = (lambda c: c) if trained is None else _unblamed
    with ckpt, HfCheckpoint(hf_dir, config=config) as hf:
        if hf.spec != spec:
            raise ConversionError(f"{hf_dir} and {nxd_dir} describe different models: {hf.spec} vs {spec}")
        if tol is None:
            tol = _default_tol(hf, ckpt)
        shards = _Shards(ckpt, spec, layout)
        sampled = _sample_layers(spec.layers, layers)
        with byte_progress(f"verify {Path(nxd_dir).name}", len(sampled), quiet=not progress, of="layers") as advance:
            for layer in sampled:
                x = torch.randn(2, 16, spec.hidden, generator=generator)
                checks = [blame(c) for c in _check_layer(x, _hf_layer(hf, layer), shards, layer, tol)]
                results["layers"][layer] = {c.name: _as_json(c) for c in checks}
                problems += [_problem(f"layer {layer} {c.name}", c, tol) for c in checks if not c.ok(tol)]
                advance(1)
        for vocab_check in map(blame, _check_vocab(hf, shards, generator)):
            results[vocab_check.name] = _as_json(vocab_check)
            if not vocab_check.ok(tol):
                problems.append(_problem(vocab_check.name, vocab_check, tol))
        if trained is not None:
            problems = _trained_problems(trained, problems, nxd_dir, hf_dir, notes)
            results["trained"] = trained
        if files:
            problems += _check_files(ckpt)
        ckpt.finish_checks()
    results.update(ok=not problems, problems=problems, tol=tol, layout=layout.to_json())
    return results


def _trained_elsewhere(meta: Any, hf_dir: Path) -> dict[str, Any] | None:
    """``{"steps": N}`` when the shards are a tag trained N steps and ``hf_dir`` is not that tag's own export."""
    record = trained_record(meta)
    if record is None:
        return None
    exported = trained_record(read_metadata(hf_dir) if Path(hf_dir).is_dir() else None, EXPORTED_FROM)
    if exported is not None and all(exported.get(k) == record.get(k) for k in ("step", "run")):
        return None
    return {"steps": record["step"]}


def _unblamed(check: Check) -> Check:
    """A check of trained weights against the model they started from: the difference is the training's, so no
    rank and no component is blamed."""
    check.ranks, check.detail = [], ""
    return check


def _trained_problems(trained: dict[str, Any], problems: list[str], nxd_dir: str | Path, hf_dir: str | Path,
                      notes: list[str]) -> list[str]:
    """What verify says first of a trained tag against another HF model (a note; the one problem if any differ)."""
    steps = trained["steps"]
    said = (f"{nxd_dir} is a training tag trained {steps} step{'s' if steps != 1 else ''} (its ckptconv.json records "
            f"step {steps}) and {hf_dir} is not its export: their weights differ by the training, not by the "
            f"conversion{f' ({len(problems)} checks differ)' if problems else ''}; to check the shards, verify them "
            f"against an export of the same tag: ckptconv to-hf {nxd_dir} EXPORT, then ckptconv verify EXPORT {nxd_dir}")
    trained["message"] = said
    notes.insert(0, said)
    return [said] if problems else []


def _check_files(ckpt: NxdCheckpoint) -> list[str]:
    """Sizes and digests of every file against ckptconv.json."""
    if ckpt.metadata is None:
        return [f"{ckpt.root}: no ckptconv.json to check file hashes against"]
    problems = []
    for rel, rec in ckpt.metadata.files.items():
        path = ckpt.root / rel
        if not path.is_file():
            problems.append(f"{rel}: missing")
        elif path.stat().st_size != rec["size"]:
            problems.append(f"{rel}: size {path.stat().st_size}, recorded {rec['size']}")
        elif not (record := FileRecord.from_json(rec)).matches(path):
            problems.append(f"{rel}: {record.algorithm} differs from ckptconv.json")
    return problems
