"""The TorchTitan lane: TorchTitan itself loads what to-dcp writes, and from-dcp reads what it saves.

Runs in ``.venv-titan`` (``make setup-titan test-titan``: torchtitan 0.3.0 from PyPI on torch 2.14.1, the
public index's default build, run on CPU); the main lane collects this module and skips it. The model is TorchTitan's own llama3
(``Llama3Model`` with its fused ``wqkv`` and split-on-save hooks) built from the tiny HF config;
its inner attention is TorchTitan's ``ScaledDotProductAttention`` module (its default FlexAttention
compiles for ~40 s per shape on CPU and has no CPU backward; the layer math around it is the same).
TorchTitan's ``Trainer`` is not used here (it needs a tokenizer and a data set): its ``CheckpointManager``,
``OptimizersContainer`` and ``LRSchedulersContainer`` are, as the trainer wires them, with the optimizer and
schedule of the ``torchtitan_config.py`` to-dcp writes.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan", reason="the TorchTitan lane: make setup-titan test-titan")

from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.optimizer import (  # noqa: E402
    LRSchedulersContainer,
    OptimizersContainer,
    ParamGroupConfig,
    default_adamw,
)
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers  # noqa: E402

import ckptconv  # noqa: E402
from ckptconv.commands.api import RunOptions  # noqa: E402
from ckptconv.core.model_spec import ModelSpec  # noqa: E402
from ckptconv.io.dcp import DcpCheckpoint  # noqa: E402
from ckptconv.titan.names import (  # noqa: E402
    OPTIMIZER_STATE_FIELDS,
    PARAM_GROUP_FIELDS,
    TITAN_VERSION,
    fused_qkv_param,
    optimizer_params,
    rope_rows,
    titan_params,
)
from ckptconv.titan.state import TitanSchedule, titan_last_epoch, titan_schedule  # noqa: E402
from tests.conftest import hf_state, warns_no_tokenizer  # noqa: E402
from tests.titan_shims import generated_config  # noqa: E402

QUIET = RunOptions(quiet=True)
pytestmark = pytest.mark.usefixtures("gloo_world")


def titan_model(hf: Path, *, fused: bool = True) -> Llama3Model:
    """TorchTitan's llama3 for the HF config at ``hf`` (the numbers its config registry would take)."""
    c = json.loads((hf / "config.json").read_text())
    dim, heads, vocab = c["hidden_size"], c["num_attention_heads"], c["vocab_size"]
    theta = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0))
    norm = {"weight": torch.nn.init.ones_}
    linear = {"weight": lambda t: torch.nn.init.normal_(t, std=0.02)}
    config = Llama3Model.Config(
        dim=dim, vocab_size=vocab, enable_weight_tying=bool(c.get("tie_word_embeddings")),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init={"weight": torch.nn.init.normal_}),
        norm=RMSNorm.Config(normalized_shape=dim, eps=c["rms_norm_eps"], param_init=norm),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=linear),
        layers=_build_llama3_layers(
            n_layers=c["num_hidden_layers"], dim=dim, n_heads=heads, n_kv_heads=c["num_key_value_heads"],
            hidden_dim=c["intermediate_size"], fuse_qkv=fused, attn_backend="flex",
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=64, theta=theta)),
    )
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention_norm = RMSNorm.Config(normalized_shape=dim, eps=c["rms_norm_eps"], param_init=norm)
        layer.ffn_norm = RMSNorm.Config(normalized_shape=dim, eps=c["rms_norm_eps"], param_init=norm)
    torch.manual_seed(1)
    model = config.build()
    model.init_states()
    return model


def manager(model: Llama3Model, folder: Path, *, optimizer=None, schedule=None, training_steps: int = 10,
            **config) -> tuple[CheckpointManager, object, object]:
    """TorchTitan's CheckpointManager wired as its Trainer wires it (AdamW, warmup schedule, train state)."""
    optimizers = (optimizer or default_adamw(lr=1e-3)).build(model_parts=[model])
    schedulers = (schedule or LRSchedulersContainer.Config(warmup_steps=2)).build(optimizers=optimizers,
                                                                                 training_steps=training_steps)

    class TrainState:
        step, ntokens_seen = 0, 0

        def state_dict(self):
            return {"step": self.step, "ntokens_seen": self.ntokens_seen}

        def load_state_dict(self, state):
            self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]

    ck = CheckpointManager(
        CheckpointManager.Config(enable=True, folder=folder.name, keep_latest_k=0, **config),
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": TrainState()}, sd_adapter=None, base_folder=str(folder.parent),
    )
    return ck, optimizers, schedulers


def hf_logits(hf: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def titan_logits(model: Llama3Model, tokens: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(tokens)


@pytest.fixture(scope="module")
def models(tiny_models) -> dict[str, Path]:
    return {"gqa": tiny_models("titan-gqa", kv_heads=2, layers=2, seed=3),
            "tied": tiny_models("titan-tied", kv_heads=2, layers=2, tied=True, seed=4),
            "mha": tiny_models("titan-mha", kv_heads=8, layers=2, seed=5)}


@pytest.mark.parametrize("name", ["gqa", "tied", "mha"])
def test_titan_loads_to_dcp_output_and_computes_hf_logits(models, tmp_path, name):
    hf = models[name]
    ckptconv.to_dcp(hf, tmp_path / "dcp", options=QUIET)
    model = titan_model(hf)
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    before = titan_logits(model, tokens)
    ck, _, _ = manager(model, tmp_path / "ck", initial_load_path=str(tmp_path / "dcp"), initial_load_model_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ck.load() is True
    ck.close()
    ours, reference = titan_logits(model, tokens), hf_logits(hf, tokens)
    assert not torch.allclose(before, reference, atol=1e-3)  # it did load something
    assert torch.allclose(ours, reference, atol=1e-5, rtol=0), (ours - reference).abs().max()
    # The fused parameter TorchTitan trains (and keys its optimizer state by) is the table's fused rows.
    spec, state = ModelSpec.from_file(hf / "config.json"), hf_state(hf)
    perm = list(rope_rows(spec.head_dim))
    for layer in range(spec.layers):
        param = fused_qkv_param(spec, layer)
        parts = []
        for piece in param.pieces:
            rows = state[piece.hf_key][piece.start:piece.stop]
            parts.append(rows.view(-1, spec.head_dim, spec.hidden)[:, perm].reshape(rows.shape) if piece.rope else rows)
        assert torch.equal(model.layers[str(layer)].attention.qkv_linear.wqkv.weight.detach(), torch.cat(parts))


def train_one_step(model: Llama3Model, optimizers, schedulers) -> None:
    model.train()
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizers.step()
    schedulers.step()
    optimizers.zero_grad()


@pytest.mark.parametrize("name", ["gqa", "tied"])
def test_from_dcp_of_a_checkpoint_titan_saved_computes_its_logits(models, tmp_path, name):
    hf = models[name]
    model = titan_model(hf)
    ck, optimizers, schedulers = manager(model, tmp_path / "ck", last_save_model_only=True)
    train_one_step(model, optimizers, schedulers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ck.save(curr_step=1, last_step=True)  # TorchTitan's final save: model only, fp32
    ck.close()
    assert (tmp_path / "ck" / "step-1" / ".metadata").is_file()
    result = ckptconv.from_dcp(tmp_path / "ck", tmp_path / "hf", config=hf / "config.json", options=QUIET)
    assert any("step-1" in n for n in result.notes)
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    ours, theirs = hf_logits(tmp_path / "hf", tokens), titan_logits(model, tokens)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()
    # and on to NxD shards, which come back to the same HF weights
    ckptconv.from_dcp(tmp_path / "ck", tmp_path / "nxd", to="nxd", tp=2, attention="qkv_linear", fuse_qkv=True,
                      config=hf / "config.json", options=QUIET)
    with warns_no_tokenizer():
        ckptconv.to_hf(tmp_path / "nxd", tmp_path / "hf2", options=QUIET)
    a, b = hf_state(tmp_path / "hf"), hf_state(tmp_path / "hf2")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_full_titan_checkpoint_has_exactly_the_state_keys_we_know(models, tmp_path):
    """TorchTitan's full checkpoint (model, AdamW state, schedule, train state): every key is one our
    table knows (optimizer state keyed by the fused wqkv, no lm_head when tied), from-dcp takes its
    model and reports the rest as not carried."""
    hf = models["tied"]
    spec = ModelSpec.from_file(hf / "config.json")
    model = titan_model(hf)
    ck, optimizers, schedulers = manager(model, tmp_path / "ck", interval=1)
    train_one_step(model, optimizers, schedulers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ck.save(curr_step=1)
    ck.close()
    with DcpCheckpoint(tmp_path / "ck") as ckpt:
        keys = set(ckpt.keys())
        assert ckpt.read_value("lr_scheduler.last_epoch") == 1
        assert ckpt.read_value("train_state.step") == 0
    expected = {p.key for p in titan_params(spec)}
    for param in optimizer_params(spec):
        expected |= {f"optimizer.state.{param}.{f}" for f in OPTIMIZER_STATE_FIELDS}
        expected |= {f"optimizer.param_groups.{param}.{f}" for f in PARAM_GROUP_FIELDS}
    expected |= {"lr_scheduler.last_epoch", "train_state.step", "train_state.ntokens_seen", "dataloader"}
    assert keys == expected
    result = ckptconv.from_dcp(tmp_path / "ck", tmp_path / "hf", config=hf / "config.json", options=QUIET)
    assert any("optimizer key(s)" in n and "not carried" in n for n in result.notes)
    tokens = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(3))
    assert torch.allclose(hf_logits(tmp_path / "hf", tokens), titan_logits(model, tokens), atol=1e-5, rtol=0)


def test_pinned_version():
    from importlib.metadata import version

    assert version("torchtitan") == TITAN_VERSION


# --------------------------------------------------------------------------------------------
# A run moved from nxdtrain to TorchTitan (and back) with its AdamW state, lr schedule and step

RUN = dict(optimizer="adamw", steps=4, decay_steps=4, warmup=1, schedule="cosine", lr=1e-3, min_lr=1e-4,
           weight_decay=0.1, checkpoint_freq=2, keep=2, tp=2)


def titan_schedule_config(schedule: TitanSchedule) -> LRSchedulersContainer.Config:
    """TorchTitan's schedule as to-dcp says to configure it."""
    return LRSchedulersContainer.Config(warmup_steps=schedule.warmup_steps, decay_type=schedule.decay_type,
                                        min_lr_factor=schedule.min_lr_factor, total_steps=schedule.total_steps)


def titan_adamw(lr: float, weight_decay: float) -> OptimizersContainer.Config:
    """nxdtrain's two AdamW groups in TorchTitan's config: the norm weights without weight decay, then the rest."""
    kwargs = {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8}
    return OptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r"norm\.weight$", optimizer_name="AdamW",
                         optimizer_kwargs={**kwargs, "weight_decay": 0.0}),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={**kwargs, "weight_decay": weight_decay}),
    ])


@pytest.fixture(scope="module", params=["gqa", "tied"])
def nxd_run(request, models, tmp_path_factory) -> dict:
    """nxdtrain: 4 AdamW steps (cosine schedule, weight decay, clipping) of a tiny model at tp 2; tags at 2 and 4."""
    from tests.nxdtrain.harness import convert, run_world, train_options

    name = request.param
    root = tmp_path_factory.mktemp(f"nxd-run-{name}")
    src = convert(models[name], root / "nxd", tp=2, attention="qkv_linear", fuse_qkv=True)
    options = train_options(**RUN)
    log = run_world(2, resume=str(src), checkpoint_dir=str(root / "ckpt"), log_jsonl=str(root / "log.jsonl"), **options)
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    return {"root": root, "log": log, "options": options, "src": src, "hf": models[name]}


def batches(options: dict, hf: Path) -> list[torch.Tensor]:
    """The global batches nxdtrain trained on, step by step."""
    from nxdtrain.config.options import TrainConfig
    from nxdtrain.data.rows import global_batches

    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    run = {k: v for k, v in options.items() if k not in ("checkpoint_freq", "keep")}
    cfg = TrainConfig.from_flat({**run, "resume": "unused", "no_checkpoint": True})
    return global_batches(cfg, vocab)


def titan_step(model: Llama3Model, optimizers, schedulers, ids: torch.Tensor) -> tuple[float, float]:
    """One TorchTitan training step as its Trainer takes it (mean token loss, clipping at 1.0); (loss, lr used)."""
    model.train()
    logits = model(ids)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters()], 1.0)
    lr = optimizers.optimizers[0].param_groups[0]["lr"]
    optimizers.step()
    schedulers.step()
    optimizers.zero_grad()
    return loss.item(), lr


def dcp_model(path: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    state = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(state, checkpoint_id=str(path))
    return state


def test_titan_continues_an_nxdtrain_run(nxd_run, tmp_path):
    """to-dcp of nxdtrain's step-2 tag; TorchTitan's CheckpointManager loads model, optimizer, lr_scheduler and
    train_state; two more TorchTitan steps on the same rows give nxdtrain's steps 3-4 (losses, lr, weights); its
    saved step 4, through from-dcp, resumes nxdtrain as nxdtrain's own step-4 tag does."""
    hf, log = nxd_run["hf"], nxd_run["log"]
    tag2, tag4 = nxd_run["root"] / "ckpt" / "step_2", nxd_run["root"] / "ckpt" / "step_4"
    result = ckptconv.to_dcp(tag2, tmp_path / "dcp", options=QUIET)
    generated = generated_config(tmp_path / "dcp")  # the optimizer and schedule of OUT/torchtitan_config.py
    with DcpCheckpoint(tmp_path / "dcp") as ckpt:
        assert ckpt.read_value("train_state.step") == 2 and ckpt.read_value("lr_scheduler.last_epoch") == 3
    recorded = torch.load(tag2 / "scheduler.pt", weights_only=True)
    _, _, schedule = titan_schedule(recorded, "scheduler.pt")
    assert any(schedule.describe() in n for n in result.notes)
    assert generated.lr_scheduler() == titan_schedule_config(schedule)
    assert generated.optimizer() == titan_adamw(RUN["lr"], RUN["weight_decay"])  # the run's two groups
    model = titan_model(hf)
    ck, optimizers, schedulers = manager(model, tmp_path / "ck", optimizer=generated.optimizer(),
                                         schedule=generated.lr_scheduler(), training_steps=RUN["steps"],
                                         initial_load_path=str(tmp_path / "dcp"), initial_load_model_only=False,
                                         exclude_from_loading=["dataloader"], interval=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ck.load() is True
    assert ck.states["train_state"].step == 2
    # the loaded param groups hold the saved weight decay per group: the norm weights' 0, the matrices' the run's
    loaded = [(p.dim(), g["weight_decay"]) for opt in optimizers.optimizers for g in opt.param_groups for p in g["params"]]
    assert sorted(set(loaded)) == [(1, 0.0), (2, RUN["weight_decay"])] and RUN["weight_decay"] > 0
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(4))
    with warns_no_tokenizer():  # no tokenizer in a test tag
        ckptconv.to_hf(tag2, tmp_path / "hf2", options=QUIET)
    ours, reference = titan_logits(model, tokens), hf_logits(tmp_path / "hf2", tokens)
    assert torch.allclose(ours, reference, atol=1e-5, rtol=0), (ours - reference).abs().max()
    rows = batches(nxd_run["options"], hf)
    for step in (3, 4):
        loss, lr = titan_step(model, optimizers, schedulers, rows[step - 1])
        assert lr == pytest.approx(log[step - 1]["lr"], rel=1e-12), step
        assert loss == pytest.approx(log[step - 1]["loss"], rel=1e-5), step
    ckptconv.to_dcp(tag4, tmp_path / "dcp4", weights_only=True, options=QUIET)
    theirs = {k: v.detach() for k, v in model.state_dict().items()}
    want = dcp_model(tmp_path / "dcp4", theirs)
    for key, value in want.items():
        assert torch.allclose(theirs[key], value, atol=1e-4, rtol=0), (key, (theirs[key] - value).abs().max())
    assert any(not torch.allclose(theirs[k], dcp_model(tmp_path / "dcp", theirs)[k], atol=1e-4) for k in theirs)
    # TorchTitan saves its step 4 (full state); from-dcp makes it an nxdtrain tag; nxdtrain's steps 5-6 from it
    # equal nxdtrain's own from its step-4 tag
    state = ck.states["train_state"]
    state.step, state.ntokens_seen = 4, 4 * 4 * 16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ck.save(curr_step=4)
    ck.close()
    result = ckptconv.from_dcp(tmp_path / "ck", tmp_path / "tag", to="nxd", tp=2, attention="qkv_linear",
                               fuse_qkv=True, config=hf / "config.json", consumed_samples=16, options=QUIET)
    assert any("a run that came from nxdtrain" in n for n in result.notes)  # last_epoch 5 = step 4 + 1
    for path in sorted((tag4 / "optim").iterdir()):  # TorchTitan's AdamW state after its steps 3-4 is nxdtrain's
        mine, want_state = torch.load(tmp_path / "tag" / "optim" / path.name, weights_only=True), torch.load(path, weights_only=True)
        tensors = sorted(k for k, v in want_state.items() if isinstance(v, torch.Tensor))
        assert tensors == sorted(k for k, v in mine.items() if isinstance(v, torch.Tensor)) and tensors
        for key in tensors:
            scale = want_state[key].abs().max()  # summation order differs (tp 2 vs one process): relative to the scale
            assert torch.allclose(mine[key], want_state[key], rtol=0, atol=1e-5 * scale), key
    from tests.nxdtrain.harness import run_world

    more = {**nxd_run["options"], "steps": 6}
    ours = run_world(2, resume=str(tmp_path / "tag"), checkpoint_dir=str(tmp_path / "a"),
                     log_jsonl=str(tmp_path / "a.jsonl"), **more)
    native = run_world(2, resume=str(tag4), checkpoint_dir=str(tmp_path / "b"), log_jsonl=str(tmp_path / "b.jsonl"),
                       **more)
    assert [r["step"] for r in ours] == [r["step"] for r in native] == [5, 6]
    for a, b in zip(ours, native, strict=True):
        assert a["lr"] == b["lr"] and a["consumed_samples"] == b["consumed_samples"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    ckptconv.to_dcp(tmp_path / "a" / "step_6", tmp_path / "a6", weights_only=True, options=QUIET)
    ckptconv.to_dcp(tmp_path / "b" / "step_6", tmp_path / "b6", weights_only=True, options=QUIET)
    a6, b6 = dcp_model(tmp_path / "a6", theirs), dcp_model(tmp_path / "b6", theirs)
    for key in theirs:
        assert torch.allclose(a6[key], b6[key], atol=1e-6, rtol=0), (key, (a6[key] - b6[key]).abs().max())


@pytest.mark.parametrize("name,warmup,step", [("cosine", 3, 5), ("linear", 2, 2), ("constant", 2, 4), ("cosine", 0, 3),
                                              ("linear", 4, 1)])
def test_titans_schedule_as_configured_gives_nxdtrains_lr(name, warmup, step):
    """TorchTitan's own LRSchedulersContainer, configured as to-dcp says and loaded with its last_epoch, computes
    nxdtrain's lr at every later step (a tag still in warmup: through warmup)."""
    from ckptconv.training.schedules import Recorded, lr_at

    record = {"schedule": name, "lr": 2e-3, "min_lr": 2e-4, "warmup": warmup, "decay_steps": 10}
    cfg, decay, schedule = titan_schedule(record, "scheduler.pt")
    assert schedule is not None
    model = torch.nn.Linear(2, 2)
    optimizers = default_adamw(lr=schedule.lr).build(model_parts=[model])
    schedulers = titan_schedule_config(schedule).build(optimizers=optimizers, training_steps=10)
    schedulers.load_state_dict({"last_epoch": titan_last_epoch(step=step, warmup=warmup)})
    group = optimizers.optimizers[0].param_groups[0]
    group["lr"] = lr_at(step + 1, cfg, decay_steps=decay)  # what to-dcp writes into the param groups
    last = 10 if step >= warmup else warmup  # to the end of the decay (TorchTitan does not hold min_lr past it)
    for n in range(step + 1, last + 1):
        assert group["lr"] == pytest.approx(lr_at(n, Recorded(**{k: record[k] for k in ("schedule", "lr", "min_lr",
                                                                                        "warmup")}),
                                                    decay_steps=10), rel=1e-9, abs=1e-15), n
        schedulers.step()
