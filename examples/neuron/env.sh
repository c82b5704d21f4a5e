# Neuron environment for nxdtrain on Trainium (source it: `. examples/neuron/env.sh`).
# Variables and their meaning from AWS's public Neuron documentation (awsdocs-neuron.readthedocs-hosted.com):
#   Neuron Runtime configuration (NEURON_RT_*), PyTorch NeuronX environment variables (NEURON_CC_FLAGS),
#   Neuron Persistent Cache, neuron_parallel_compile. Untested here: no Neuron hardware was available.

# The XLA device nxdtrain trains on (--device xla); torch-neuronx provides the NEURON PJRT plugin.
export PJRT_DEVICE=NEURON

# Compiler flags. --cache_dir: the Neuron persistent cache of compiled graphs (NEFFs); put it on a file system every
# node sees, so the precompile run (precompile.sh) fills it once and every later run and node only loads.
# --model-type transformer: the compiler's transformer tuning. --retry_failed_compilation: recompile a graph whose
# earlier compile failed instead of reusing the failure from the cache.
NEURON_CACHE_DIR=${NEURON_CACHE_DIR:-$HOME/neuron-cache}
export NEURON_CC_FLAGS="${NEURON_CC_FLAGS:---model-type transformer --retry_failed_compilation} --cache_dir=$NEURON_CACHE_DIR"

# Neuron Runtime: log level, and the seconds one graph execution may take before the runtime gives up
# (the first steps load large graphs; the default is short). torchrun gives each process its own NeuronCore:
# do not set NEURON_RT_VISIBLE_CORES / NEURON_RT_NUM_CORES yourself unless you partition an instance by hand.
export NEURON_RT_LOG_LEVEL=${NEURON_RT_LOG_LEVEL:-WARNING}
export NEURON_RT_EXEC_TIMEOUT=${NEURON_RT_EXEC_TIMEOUT:-600}

# Multi-node collectives go over EFA (libfabric).
export FI_PROVIDER=efa
export FI_EFA_USE_DEVICE_RDMA=1
export FI_EFA_FORK_SAFE=1

# Host memory: glibc creates an arena per thread; bound them (the host holds data and checkpoint buffers only).
export MALLOC_ARENA_MAX=64
