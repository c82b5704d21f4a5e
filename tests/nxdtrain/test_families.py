"""nxdtrain trains Mistral, Qwen2 and Qwen3 shards like the family's transformers class (fp32).

Mistral: head_dim 16 != 64 / 8 and rows of 32 tokens over a window of 16 (MistralForCausalLM masks the rest);
Qwen2: q/k/v biases, also replicated under kv_size_multiplier 2; Qwen3: per-head q/k norms (their gradients
summed over tp), head_dim 16, tied embeddings across pipeline stages. A tied Llama with 1003 tokens trains from
shards padded to 1004 rows like transformers on the real 1003. SGD runs compare exported weights within
1e-6, AdamW runs losses within 1e-5 (and weights within 1e-4).
"""

from __future__ import annotations

import pytest

from nxdtrain.train import export
from tests.conftest import warns_no_tokenizer
from tests.nxdtrain.harness import run_world, train_options
from tests.nxdtrain.test_parity import assert_matches_reference

CASES = {
    # name: (model, tp, pp, layout, optimizer, extra options)
    "mistral-tp2-pp2-fused-sgd": ("mistral", 2, 2, dict(attention="qkv_linear", fuse_qkv=True), "sgd", {}),
    "mistral-tp2-pp2-adamw": ("mistral", 2, 2, dict(attention="qkv_linear"), "adamw", {}),
    "qwen2-tp2-pp2-fused-sgd": ("qwen2", 2, 2, dict(attention="qkv_linear", fuse_qkv=True), "sgd", {}),
    "qwen2-tp4-kvm2-trn2-adamw": ("qwen2", 4, 1, dict(attention="qkv_linear", kv_size_multiplier=2, hw_backend="trn2"),
                                  "adamw", {}),
    "qwen2-separate-tp2-sgd": ("qwen2", 2, 1, dict(attention="separate"), "sgd", {}),
    "qwen3-tp2-pp2-fused-sgd": ("qwen3", 2, 2, dict(attention="qkv_linear", fuse_qkv=True), "sgd", {}),
    "qwen3-tp4-kvm2-fused-sgd": ("qwen3", 4, 1, dict(attention="qkv_linear", fuse_qkv=True, kv_size_multiplier=2),
                                 "sgd", {}),
    "qwen3-tp2-pp2-sp-adamw": ("qwen3", 2, 2, dict(attention="qkv_linear", fuse_qkv=True), "adamw",
                               dict(sequence_parallel=True)),
    # vocabulary 1003, tied: padded to 1004 rows in the shards, padding logits masked, export gives 1003 rows back
    "vocab1003-tp4-kvm2-fused-sgd": ("vocab1003", 4, 1, dict(attention="qkv_linear", fuse_qkv=True,
                                                             kv_size_multiplier=2), "sgd", {}),
    "vocab1003-tp2-pp2-fused-sgd": ("vocab1003", 2, 2, dict(attention="qkv_linear", fuse_qkv=True), "sgd", {}),
    "vocab1003-tp2-pp2-adamw": ("vocab1003", 2, 2, dict(attention="qkv_linear"), "adamw", {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_family_trains_like_transformers(tmp_path, nxd_model, reference, name):
    model, tp, pp, layout, optimizer, extra = CASES[name]
    seq_len = 32 if model == "mistral" else 16
    options = train_options(optimizer=optimizer, lr=0.05 if optimizer == "sgd" else 1e-3, mbs=2, seq_len=seq_len)
    src = nxd_model(model, tp=tp, pp=pp, **layout)
    log = run_world(tp * pp, resume=str(src), tp=tp, pp=pp, checkpoint_dir=str(tmp_path / "ckpt"),
                    log_jsonl=str(tmp_path / "log.jsonl"), **options, **extra)
    with warns_no_tokenizer():
        export(tmp_path / "ckpt", tmp_path / "hf")
    assert_matches_reference(log, tmp_path / "hf", reference(model, **options), optimizer)


def test_a_sliding_window_shorter_than_the_rows_is_refused_with_context_parallelism(nxd_model):
    from nxdtrain.config.options import TrainConfig
    from nxdtrain.errors import TrainError
    from nxdtrain.train import prepare

    src = str(nxd_model("mistral", tp=1, pp=1, attention="qkv_linear"))
    config = TrainConfig.from_flat({"no_checkpoint": True, **train_options(resume=src, seq_len=32, context_parallel=2)})
    with pytest.raises(TrainError, match=r"^config.json: sliding_window 16 < --seq-len 32 with --context-parallel 2: "
                                         r"ring attention has no window mask"):
        prepare(config, 2)
