# Egress gateway sidecar image.
#
# Two stages: the builder installs the project's wheel and its dependencies into a venv at
# /opt/venv; the runtime stage copies only that venv onto the same base image, so no
# compiler, pip cache or source tree ships. Both stages use the same base, pinned by tag
# and by the multi-platform index digest, so the venv's interpreter symlinks stay valid.
# To move the base: update tag and digest together (`docker buildx imagetools inspect`).

FROM python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

WORKDIR /src
RUN python -m venv /opt/venv

# Dependencies in their own layer, rebuilt only when the lock changes. The image carries
# every feature the docs describe, since its users cannot pip install into it:
# requirements.lock pins every package of [project.dependencies] plus every extra of the
# sidecar itself, each imported only when the policy uses it: `fast` (uvloop, orjson: less
# CPU per call), `otel` (traces over OTLP/HTTP), `database` (asyncpg, database targets)
# and `a2a` (PyJWT[crypto], a2a.card.verify); `dev` and `demo` are not the sidecar's. With
# their dependencies, each with the hashes of its files on PyPI, so two builds install
# the same bytes and a tampered download fails. After a change of pyproject.toml's
# dependencies, regenerate it (tests/test_dockerfile.py checks that it matches) with the
# command in its header:
#   uv pip compile pyproject.toml --extra fast --extra otel --extra database --extra a2a \
#       --generate-hashes --python-version 3.11 --python-platform linux --no-cache \
#       -o requirements.lock
COPY requirements.lock ./
RUN pip install --require-hashes --no-deps --requirement requirements.lock

# The project itself, built as a wheel and installed without touching the dependencies.
COPY README.md ./
COPY gateway/ ./gateway/
# The price table (gateway/cost/table.py) written into the installed package, so that a
# sidecar never reads genai-prices' data itself (-P: the installed gateway, not ./gateway).
RUN pip wheel --no-deps --wheel-dir /tmp/wheels . \
    && pip install --no-deps /tmp/wheels/*.whl \
    && python -P -c "from gateway.cost.table import main; main(['--write'])" \
    && python -m compileall -q /opt/venv/lib


FROM python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d AS runtime

LABEL org.opencontainers.image.title="egress-gateway" \
      org.opencontainers.image.description="Egress sidecar for AI agents: policy-checked, credential-injecting, audited outbound calls." \
      org.opencontainers.image.licenses="Apache-2.0"

# A fixed UID/GID, so Kubernetes runAsUser/fsGroup (10001 in the Helm chart) match the
# files' owner. No home directory, no login shell.
RUN groupadd --system --gid 10001 gateway \
    && useradd --system --no-log-init --uid 10001 --gid 10001 \
       --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin gateway

COPY --from=builder /opt/venv /opt/venv
# nft, for the chart's egress.enforce init container (deploy/egress-gateway-enforce, run
# as root with NET_ADMIN in that container only; the sidecar never has the capability).
# Pinned to bookworm's version: bump it with the base image.
RUN apt-get update \
    && apt-get install -y --no-install-recommends nftables=1.0.6-2+deb12u2 \
    && rm -rf /var/lib/apt/lists/*

# Default policies; the Helm chart mounts its ConfigMap over this directory.
COPY policies/ /etc/egress-gateway/
# The egress enforcement script (executable in the repository; COPY keeps the mode).
COPY deploy/egress-gateway-enforce /usr/local/bin/egress-gateway-enforce

# Nothing is written outside /tmp: no bytecode, HOME and TMPDIR in /tmp (an emptyDir
# under a read-only root filesystem), audit records to stdout, unbuffered.
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONFAULTHANDLER=1 \
    HOME=/tmp \
    TMPDIR=/tmp

USER 10001:10001
WORKDIR /tmp

# 8182: the ops listener (/healthz, /readyz, /metrics; set GATEWAY_OPS_HOST=0.0.0.0 in a
# pod). The calls API on 8181 listens on 127.0.0.1 only and is deliberately not exposed.
EXPOSE 8182

# Exec form: egress-gateway is PID 1 and receives SIGTERM itself (graceful drain).
STOPSIGNAL SIGTERM
ENTRYPOINT ["egress-gateway"]
CMD ["serve", "--policy", "/etc/egress-gateway/policy.yaml"]
