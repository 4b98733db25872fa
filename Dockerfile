# CPU image: Python 3.11, torch's CPU wheels and shardserve, installed by `make install` exactly as on a
# developer machine (only the venv path, the torch index and the extras differ).
#   docker build -t shardserve:0.1.0 .
# Runs `shardserve serve` by default; on Kubernetes KubeRay starts `ray start` in it instead (k8s/).
# The default model is fetched into $SHARDSERVE_CACHE on first use: mount a volume there to keep it,
# or mount a model and pass its path.
FROM python:3.11-slim

# make runs the install; wget is what KubeRay's injected liveness and readiness probes call
RUN apt-get update && apt-get install -y --no-install-recommends make wget \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/shardserve
COPY . .
ARG TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu"
ENV PIP_NO_CACHE_DIR=1
RUN make install VENV=/opt/venv TORCH_INDEX="$TORCH_INDEX" EXTRAS=

ENV PATH=/opt/venv/bin:$PATH \
    SHARDSERVE_CACHE=/var/cache/shardserve
EXPOSE 8000 50051
CMD ["shardserve", "serve", "--host", "0.0.0.0"]
