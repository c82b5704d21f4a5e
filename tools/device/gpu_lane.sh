#!/usr/bin/env bash
# The GPU lane, for a machine with one or more CUDA devices and no package index (the device machines this project
# is lent): wheels of what the image lacks come in .whl/ (blake3, isal, omegaconf, antlr4-python3-runtime; see
# docs/development.md), the image's own torch, transformers and pytest do the rest. Writes its logs to $OUT (or
# /tmp/gpu-lane). Steps: the CUDA tests (tests/nxdtrain/test_cuda.py), the CLIs end to end as a user runs them
# (to-nxd, nxdtrain run on the GPU, a resume, --nproc 2 on a one-GPU node refused, to-hf), then
# benchmarks/train.py's tp 1 rows in bf16 against transformers on the same GPU.
set -u
OUTDIR=${OUT:-/tmp/gpu-lane}
mkdir -p "$OUTDIR"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
W=$(mktemp -d /tmp/gpu-lane.XXXX)
ckptconv() { python3 -m ckptconv.cli "$@"; }
nxdtrain() { python3 -c 'import sys; from nxdtrain.cli import main; sys.exit(main())' "$@"; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
torch.cuda.nccl.version(), transformers.__version__, torch.cuda.device_count(), "GPU(s)")'; } 2>&1 | tee "$OUTDIR/env.txt"

timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -n 0 -p no:cacheprovider -rs tests/nxdtrain/test_cuda.py \
  tests/nxdtrain/test_device.py 2>&1 | tee "$OUTDIR/tests.log"

{ python3 -c "from pathlib import Path; from tests.conftest import make_tiny_llama
make_tiny_llama(Path('$W/hf'), hidden=256, heads=8, kv_heads=2, head_dim=32, layers=4, vocab=1024, intermediate=688)"
  ckptconv to-nxd "$W/hf" "$W/nxd" --tp 1 --pp 1 --quiet
  echo "== nxdtrain run on the GPU (device auto, its default precision)"
  nxdtrain run --resume "$W/nxd" --data synthetic --seq-len 512 --gbs 8 --mbs 4 --steps 4 --decay-steps 6 --checkpoint-freq 2 \
    --checkpoint-dir "$W/ckpt" --log-jsonl "$W/log.jsonl"; echo "exit $?"
  echo "== resume from its own tag, 2 more steps"
  nxdtrain run --resume "$W/ckpt" --data synthetic --seq-len 512 --gbs 8 --mbs 4 --steps 6 --decay-steps 6 \
    --checkpoint-dir "$W/ckpt" --log-jsonl "$W/log2.jsonl"; echo "exit $?"
  echo "== the same 6 steps without a stop (the resume's steps 5-6 should match)"
  nxdtrain run --resume "$W/nxd" --data synthetic --seq-len 512 --gbs 8 --mbs 4 --steps 6 --decay-steps 6 \
    --no-checkpoint --log-jsonl "$W/straight.jsonl" >/dev/null; echo "exit $?"
  python3 -c "import json; rows = lambda p: [json.loads(l) for l in open(p)]
s, r = rows('$W/straight.jsonl'), rows('$W/log2.jsonl')
print('straight', [x['loss'] for x in s]); print('resumed ', [x['loss'] for x in r])"
  echo "== two ranks on a node with $(python3 -c 'import torch; print(torch.cuda.device_count())') GPU(s)"
  nxdtrain run --resume "$W/nxd" --data synthetic --seq-len 64 --gbs 4 --mbs 1 --steps 1 --nproc 2 \
    --no-checkpoint; echo "exit $?"
  echo "== back to HF"
  ckptconv to-hf "$W/ckpt" "$W/hf-out" --quiet; echo "exit $?"
  cat "$W/log.jsonl" "$W/log2.jsonl"
} 2>&1 | tee "$OUTDIR/cli.log"

timeout "${BENCH_TIMEOUT:-240}" python3 benchmarks/train.py --rows tp1 --modes none,selective,full --precision bf16 \
  --peak-tflops "${PEAK_TFLOPS:-989}" --long-seq 0 --hidden 2048 --layers 8 --seq 2048 --gbs 16 --mbs 4 --steps 5 --warmup 2 \
  --workdir "$W/bench" 2>&1 | tee "$OUTDIR/bench.log"
cp bench-out/train.md "$OUTDIR/" 2>/dev/null
exit 0
