#!/usr/bin/env bash
# Download, on a machine with package access, the wheels that the project's Petals stack needs
# on a GPU machine that reaches no package registry (Python 3.12 there, with a CUDA torch,
# numpy, scipy, pandas, pyarrow and accelerate already installed). Writes them to DEST
# (default: .whl/ at the root of the checkout you run it from, about 45 MB) and git-ignores
# that folder through .git/info/exclude.
#   benchmarks/gpu/fetch_wheels.sh            # from the repository root
# Then send .whl/ with the checkout to the GPU machine; benchmarks/RESULTS.md ("GPU benchmark:
# how to run it") has the lines to run there.
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
DEST=${DEST:-$ROOT/.whl}
EXCLUDE=$(git rev-parse --path-format=absolute --git-path info/exclude)  # also right in a git worktree
mkdir -p "$DEST" "$(dirname "$EXCLUDE")"
grep -qx '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >> "$EXCLUDE"
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform any)
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLAT+=(--platform "$p")
done
# Binary wheels (one version each; tokenizers <0.14 has no cp312 wheel: 0.15.2 is used and
# transformers' import-time version check is relaxed on the GPU machine, see benchmarks/RESULTS.md).
BIN="hivemind==1.1.12 petals==2.2.0.post1 transformers==4.33.3 tokenizers==0.15.2 huggingface_hub==0.36.2
 datasets==5.0.1 dill==0.4.1 multiprocess==0.70.19 grpcio==1.85.1 grpcio-tools==1.85.1 protobuf==7.36.2
 ConfigArgParse==1.9.0 py-multihash==3.0.0 py-cid==0.5.0 py-multibase==2.0.0 py-multicodec==1.0.0 morphys==1.0
 mmh3==5.3.1 base58==2.1.1 netaddr==1.3.0 pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0
 typing-inspection==0.4.5 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 speedtest-cli==2.1.3
 humanfriendly==10.0 async-timeout==5.0.1 Dijkstar==2.6.0 tensor-parallel==1.0.23 blake3==1.0.11 xxhash==4.1.0"
for spec in $BIN; do
  python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$DEST" "$spec"
done
# Pure-Python packages published as source only: build their wheels here.
python3 -m pip wheel -q --no-deps -w "$DEST" python-baseconv==1.2.2 varint==1.0.2 prefetch_generator==1.0.3
du -sh "$DEST"
