# CPU image: Python 3.11, torch's CPU wheels and shardserve, installed by `make install` exactly as on a
# developer machine (only the venv path, the torch index and the extras differ), every package at the
# version of requirements.lock. The base is pinned by digest (python:3.11-slim, multi-arch index); refresh
# it with `docker buildx imagetools inspect python:3.11-slim` and the lock with `make lock`.
#   docker build -t shardserve:0.1.0 .
# Runs as the non-root user shardserve (uid 1000). `shardserve serve --host 0.0.0.0` refuses to start
# without an API key: pass one from a secret file (docker run -v keys:/run/secrets/shardserve:ro ... and
# --api-key-file) or SHARDSERVE_API_KEY. On Kubernetes KubeRay starts `ray start` in it instead (k8s/).
# The default model is fetched into $SHARDSERVE_CACHE on first use: mount a volume there to keep it,
# or mount a model and pass its path.
FROM python:3.11-slim@sha256:9c900dea9e8fb7e16277c179b555cc72d29a352dbc33cff48ad5a0412fd5bfc7

# make runs the install; wget is what KubeRay's injected liveness and readiness probes call; g++ builds
# the CPU decode-attention kernel (kernels/cpu_attention.c) and `--compile` kernels on first use
RUN apt-get update && apt-get install -y --no-install-recommends make wget g++ libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/shardserve
COPY . .
ARG TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu"
ENV PIP_NO_CACHE_DIR=1
RUN make install VENV=/opt/venv TORCH_INDEX="$TORCH_INDEX" EXTRAS=

RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin shardserve \
    && mkdir -p /var/cache/shardserve && chown shardserve:shardserve /var/cache/shardserve
ENV PATH=/opt/venv/bin:$PATH \
    SHARDSERVE_CACHE=/var/cache/shardserve
USER 1000
EXPOSE 8000 50051
CMD ["shardserve", "serve", "--host", "0.0.0.0"]
