#!/usr/bin/env bash
# What a session lent a GPU runs, in one device call (about 7 minutes on an H100, well inside one call's
# 10-minute limit): the GPU image's Python gets pydantic and its needs from wheels carried in .whl/, then
#   1. bench/gpu_profile.py: GPT and Llama bf16 iterations (a case the GPU has no memory for is skipped and
#      named in out-of-memory.json), the op grid and layer profiles;
#   2. bench/gpu_export_check.py: tagplan's exported torch program on the GPU (bf16, NCCL, one rank);
#   3. every third GPT case again (the run-to-run spread);
# each under its own time limit, so a part cut off leaves the others' bundles. Everything lands in one
# tarball under $OUT (the device tool brings back at most 8 files, two folders deep).
#
# Before the call, here, once per machine (.whl/ is ignored by git; see the device tool's README):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     pydantic pydantic-core annotated-types typing-inspection typing-extensions
# (pydantic-core must be the version the pydantic wheel names). Then run this with carry [".whl"]:
#   bash bench/gpu_session.sh
# and unpack $OUT/gpu.tgz into bench/data/gpu/<device>/ (docs/FIDELITY.md, bench/data/gpu/README.md).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
out="${OUT:-/tmp/gpu-out}"
mkdir -p "$out" /tmp/gpu-bundles
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,power.limit,driver_version --format=csv \
  > "$out/device.txt" 2>&1
python3 -c "import torch; p = torch.cuda.get_device_properties(0); print(torch.__version__, p.name, \
p.multi_processor_count, p.total_memory)" >> "$out/device.txt" 2>&1
# the host that issues the kernels: host-bound runs move with its CPU (docs/FIDELITY.md, section (e))
{ lscpu | grep -E "^(Model name|Socket|Core|Thread|CPU\(s\)|CPU max MHz)"; nproc; } > "$out/host.txt" 2>&1
timeout 300 python3 bench/gpu_profile.py --out /tmp/gpu-bundles --only iterations,llama,ops,layers \
  > "$out/profile-log.txt" 2>&1
timeout 170 python3 bench/gpu_export_check.py --out /tmp/gpu-bundles > "$out/export-log.txt" 2>&1
timeout 45 python3 bench/gpu_profile.py --out /tmp/gpu-bundles --only repeat >> "$out/profile-log.txt" 2>&1
tar czf "$out/gpu.tgz" -C /tmp/gpu-bundles .
tail -3 "$out/profile-log.txt"; tail -9 "$out/export-log.txt"; cat "$out/device.txt" "$out/host.txt"
