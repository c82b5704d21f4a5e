#!/usr/bin/env bash
# nxdtrain on one trn1/trn2 instance: one process per NeuronCore, started by torchrun.
#   examples/neuron/train.sh /fsx/llama-nxd-tp8 /fsx/ckpt [more nxdtrain run flags]
# The shards must be cut for --tp (ckptconv to-nxd/reshard ... --tp 8 --pp 1); dp = processes / tp.
# Pipeline parallelism is not available on --device xla (nxdtrain refuses --pp > 1 there).
# Untested here: no Neuron hardware was available (see the README, "nxdtrain on Trainium (torch-xla)").
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/env.sh"
resume=${1:?usage: train.sh RESUME CHECKPOINT_DIR [nxdtrain run flags]}
ckpt=${2:?usage: train.sh RESUME CHECKPOINT_DIR [nxdtrain run flags]}
shift 2
# trn1.32xlarge: 32 NeuronCores; trn2.48xlarge: 64 (logical NeuronCores at the default LNC=2).
procs=${NEURON_PROCS_PER_NODE:-32}
exec torchrun --nproc_per_node "$procs" --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" \
    --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" \
    -m nxdtrain.cli run --device xla --resume "$resume" --checkpoint-dir "$ckpt" \
    --tp 8 --precision bf16 --seq-len 4096 --mbs 1 --gbs 64 --log-every 10 --xser "$@"
