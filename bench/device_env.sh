# On the lent GPU, after the staging calls (bench/README.md, "On the lent H200"): `. bench/device_env.sh`
# from a source tree (the working tree the call carried, or an unpacked `git archive` of another
# commit) links its server/, kernels/ and models/ as the `lockstep` namespace under NS (default
# /tmp/ns; give a base tree its own, e.g. NS=/tmp/nsb) and puts it after the staged wheels on
# PYTHONPATH. Prints the GPU, which every figure must name.
ns=${NS:-/tmp/ns}
mkdir -p "$ns/lockstep"
for d in server kernels models; do ln -sfn "$PWD/$d" "$ns/lockstep/$d"; done
export PYTHONPATH=/tmp/site:$ns
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no GPU here"
