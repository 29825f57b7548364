# The image cluster/kuberay/<region>.yaml and cluster/regions/<region>.yaml run on every node: Ray 2.60's GPU image
# (Python 3.11 on NVIDIA's CUDA base), a CUDA build of torch, and ray-diloco with its dependencies. Build it from
# the repository root and push it to a registry every cluster can pull from, under the name the manifests give
# (replace YOUR_ORG there and here):
#
#   docker build -t ghcr.io/YOUR_ORG/ray-diloco:0.1.0-gpu .
#   docker push ghcr.io/YOUR_ORG/ray-diloco:0.1.0-gpu
#
# The tag carries the package's version (pyproject.toml); the base's Ray is the release pyproject.toml pins and
# the RayClusters' rayVersion names (every node of a cluster must run the same Ray). tests/test_cluster_configs.py
# checks these against each other and the manifests; the image has not been built from this repository.
FROM rayproject/ray:2.60.0-py311-gpu

# torch first, so that `pip install` below finds it. PyPI's Linux x86_64 wheels are CUDA builds (torch 2.13.0:
# CUDA 13.0, whose libraries come as pip packages; the GPU nodes need an NVIDIA driver >= 580). For an older
# driver take a build from PyTorch's index, e.g. --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu126
# (check that it has the version).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://pypi.org/simple
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

# ray-diloco and the rest of its dependencies (the base image already has the Ray it pins). README.md: pyproject.toml
# names it as the package's readme. The `ray-diloco` command lands on the PATH the RayJob entrypoint uses.
COPY --chown=ray:users pyproject.toml README.md /tmp/ray-diloco/
COPY --chown=ray:users ray_diloco /tmp/ray-diloco/ray_diloco
RUN pip install --no-cache-dir /tmp/ray-diloco && rm -rf /tmp/ray-diloco
