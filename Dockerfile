# The pd-extproc sidecar (and the vllmsim simulator, which docker-compose.yml uses as engines).
# Build: docker build -t pd-extproc:local .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Only what the package needs: a change to tests or docs keeps the install layer cached.
WORKDIR /build
COPY pyproject.toml README.md ./
COPY extproc ./extproc
COPY vllmsim ./vllmsim
RUN pip install . && rm -rf /build

# An unprivileged user: the sidecar needs no root (its ports are above 1024).
RUN useradd --system --uid 10001 --user-group --home-dir /home/pd --create-home pd
USER 10001:10001
WORKDIR /home/pd

# gRPC (ext_proc) and /metrics; 8000 is the simulator's HTTP port in docker-compose.yml.
EXPOSE 50051 9464 8000
CMD ["pd-extproc", "--help"]
