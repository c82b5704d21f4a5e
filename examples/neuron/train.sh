#!/usr/bin/env bash
# nxdtrain on one trn1/trn2 instance (or one node of slurm.sbatch): one process per NeuronCore, started by torchrun.
#   examples/neuron/train.sh /fsx/llama-nxd-tp8 /fsx/ckpt --data /fsx/tokenized [more nxdtrain run flags]
#   (--data is required: a dataset, or --data synthetic for random tokens)
#   INSTANCE=trn2 TP=16 examples/neuron/train.sh ...      # trn2.48xlarge: 64 processes
#   DRY_RUN=1 examples/neuron/train.sh ...                # check and print the command only
# Every start runs `--resume auto --init INIT`: the newest completed tag in CKPT when there is one (a restarted
# job continues), else the converted shards INIT (weights only). The shards must be cut for --tp (ckptconv
# to-nxd/reshard ... --tp 8 --pp 1); dp = processes / tp. Pipeline parallelism is not available on --device xla
# (nxdtrain refuses --pp > 1 there).
# Processes per node (PROCS_PER_NODE) default to INSTANCE's NeuronCores: trn1 (trn1.32xlarge: 16 Trainium chips x 2
# = 32) or trn2 (trn2.48xlarge: 16 Trainium2 chips x 8 physical cores, 64 logical NeuronCores at the default
# LNC=2; 128 with NEURON_LOGICAL_NC_CONFIG=1). NNODES x PROCS_PER_NODE must be a multiple of TP x PP: checked first.
# Untested on hardware: no Neuron instance was available (see the README, "nxdtrain on Trainium (torch-xla)");
# the dry run is tested (tests/test_examples_neuron.py).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
init=${1:?usage: train.sh INIT CHECKPOINT_DIR [nxdtrain run flags]}
ckpt=${2:?usage: train.sh INIT CHECKPOINT_DIR [nxdtrain run flags]}
shift 2
INSTANCE=${INSTANCE:-trn1}
TP=${TP:-8}
PP=${PP:-1}
case $INSTANCE in
trn1) default_procs=32 ;;
trn2) if [[ ${NEURON_LOGICAL_NC_CONFIG:-2} == 1 ]]; then default_procs=128; else default_procs=64; fi ;;
*) echo "train.sh: INSTANCE must be trn1 or trn2, got '$INSTANCE'" >&2; exit 2 ;;
esac
procs=${PROCS_PER_NODE:-$default_procs}
nodes=${NNODES:-1}
world=$((nodes * procs))
if (( world % (TP * PP) != 0 )); then
    echo "train.sh: $nodes nodes x PROCS_PER_NODE $procs (INSTANCE $INSTANCE) = $world processes; TP $TP x PP $PP" \
         "= $((TP * PP)) does not divide them; change the nodes, PROCS_PER_NODE or TP/PP" >&2
    exit 2
fi
command=(torchrun --nproc_per_node "$procs" --nnodes "$nodes" --node_rank "${NODE_RANK:-0}"
         --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}"
         -m nxdtrain.cli run --device xla --resume auto --init "$init" --checkpoint-dir "$ckpt"
         --tp "$TP" --pp "$PP" --precision bf16 --seq-len 4096 --mbs 1 --gbs 64 --log-every 10 --xser "$@")
if [[ ${DRY_RUN:-0} == 1 ]]; then printf '%q' "${command[0]}"; printf ' %q' "${command[@]:1}"; printf '\n'; exit 0; fi
. "$here/env.sh"
exec "${command[@]}"
