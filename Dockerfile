# ringserve image: one image for the coordinator and the workers (docker-compose.yml, deploy/kubernetes/).
#   docker build -t ringserve .
# A slim Python 3.11 base, the CPU build of torch (the default torch wheel would pull CUDA, gigabytes),
# ringserve with its torch extra, the examples, and a non-root user.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first and alone, from the CPU index: the torch extra below is then already satisfied.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY ringserve ./ringserve
RUN pip install ".[torch,status]"
COPY examples ./examples

RUN groupadd --gid 10001 ringserve && useradd --create-home --uid 10001 --gid 10001 ringserve
USER 10001:10001

# Both roles listen on every interface of the container; workers advertise the address that routes
# to the coordinator (RINGSERVE_ADVERTISE_HOST=auto), so replicas need no names or fixed ports.
ENV RINGSERVE_HOST=0.0.0.0 \
    RINGSERVE_PORT=50051 \
    RINGSERVE_BIND_HOST=0.0.0.0 \
    RINGSERVE_ADVERTISE_HOST=auto
EXPOSE 50051

CMD ["ringserve", "coordinator"]
