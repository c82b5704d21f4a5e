#!/usr/bin/env bash
# Fill the Neuron persistent cache before training: neuron_parallel_compile runs a short trial of the same
# command with NEURON_EXTRACT_GRAPHS_ONLY set (graphs are recorded, outputs are zeros), then compiles every
# graph it saw in parallel into NEURON_CC_FLAGS's --cache_dir. Run it with exactly the flags of the real run
# (shapes, tp, dp, precision, microbatches decide the graphs); nxdtrain's step is one graph, so a few steps suffice.
#   examples/neuron/precompile.sh /fsx/llama-nxd-tp8 --data /fsx/tokenized [the same nxdtrain run flags as train.sh]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
init=${1:?usage: precompile.sh INIT [nxdtrain run flags]}
shift
scratch=$(mktemp -d)  # the trial's checkpoints hold zeros: never write them where a real run resumes from
trap 'rm -rf "$scratch"' EXIT
neuron_parallel_compile "$here/train.sh" "$init" "$scratch/ckpt" --steps 5 "$@"
