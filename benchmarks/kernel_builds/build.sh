# Device: build the trimmed flash-attn and causal-conv1d (benchmarks/kernel_builds/stage.py) for sm_90, side by
# side, each straight into a wheel that is installed into /tmp/gpu-site (where .gpu/activate.sh puts the other
# carried packages), so importlib.metadata and `ftcli doctor` see their versions. Logs: /tmp/build/<pkg>.log;
# /tmp/build/<pkg>.done holds "<exit code> <seconds> s" when a build ends. Run from the project root with
#     setsid nohup bash .sdist/build.sh > /tmp/build.out 2>&1 &
set -u
here=$(cd "$(dirname "$0")" && pwd)   # the folder stage.py wrote: builds.tar.xz and the build-time wheels
mkdir -p /tmp/build /tmp/build-site /tmp/gpu-site && cd /tmp/build && tar -xJf "$here/builds.tar.xz"
missing=""
for m in setuptools wheel packaging psutil ninja einops; do python3 -c "import $m" 2>/dev/null || missing="$missing $m"; done
echo "missing for the build:$missing" > env.log
for m in $missing; do python3 -m pip install -q --no-index --no-deps --target /tmp/build-site "$here"/$m-*.whl >> env.log 2>&1; done
python3 -c "import einops" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/gpu-site "$here"/einops-*.whl >> env.log 2>&1  # flash-attn imports it
export PYTHONPATH=/tmp/build-site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/build-site/bin:$PATH
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")}
export TORCH_CUDA_ARCH_LIST=9.0 FLASH_ATTN_CUDA_ARCHS=90 FLASH_ATTENTION_FORCE_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE
{ nvcc --version | tail -2; python3 -c "import torch; print(torch.__version__, torch.version.cuda)"; nproc; } >> env.log 2>&1
build() {  # $1 source dir, $2 log name, $3 MAX_JOBS, $4 NVCC_THREADS
  local t0=$SECONDS
  ( cd "$1" && MAX_JOBS=$3 NVCC_THREADS=$4 python3 setup.py bdist_wheel -d /tmp/build/dist > "/tmp/build/$2.log" 2>&1 ) &&
    python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/gpu-site /tmp/build/dist/"${1%%-*}"-*.whl >> "/tmp/build/$2.log" 2>&1
  echo "$? $((SECONDS - t0)) s" > "/tmp/build/$2.done"
}
build causal_conv1d-1.7.0 causal-conv1d 3 1 &
build flash_attn-2.8.3.post2 flash-attn 7 2 &
wait
