# thinkpool image, one file for both variants, chosen by DEVICE:
#   docker build -t thinkpool:cpu .                            # CPU torch: the API, the Ray head, the CLI
#   docker build --build-arg DEVICE=cuda -t thinkpool:cuda .   # CUDA torch: the GPU workers
# The CUDA variant takes PyPI's Linux x86-64 torch wheel, which is a CUDA build (its CUDA libraries come as
# nvidia-* wheels; the driver comes from the host through the NVIDIA container toolkit). For another CUDA
# version, or aarch64 GPU hosts, name a PyTorch wheel index: --build-arg TORCH_CUDA_INDEX=<index URL for cuXYZ>.
# The build stops if the torch it installed does not match DEVICE.
FROM python:3.11-slim
ARG DEVICE=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_CUDA_INDEX=
WORKDIR /app
# torch first, in its own layer: code changes do not reinstall it
RUN set -eu; \
    case "$DEVICE" in \
      cpu)  pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "$TORCH_CPU_INDEX" ;; \
      cuda) if [ -n "$TORCH_CUDA_INDEX" ]; then \
              pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "$TORCH_CUDA_INDEX"; \
            else \
              pip install --no-cache-dir "torch==${TORCH_VERSION}"; \
            fi ;; \
      *)    echo "DEVICE must be cpu or cuda, not '$DEVICE'" >&2; exit 2 ;; \
    esac; \
    python -c "import sys, torch; cuda = torch.version.cuda is not None; \
sys.exit(0 if cuda == ('$DEVICE' == 'cuda') else 'DEVICE=$DEVICE but torch ' + torch.__version__ + ' has CUDA: ' + str(cuda))"
COPY pyproject.toml README.md ./
COPY orchestrator orchestrator
COPY workers workers
COPY dms_runtime dms_runtime
COPY policies policies
COPY tasks tasks
COPY training training
COPY evaluation evaluation
COPY configs configs
COPY checkpoints checkpoints
# the torch above satisfies the project's pin (a local label such as +cpu matches ==X.Y.Z), so it stays
RUN pip install --no-cache-dir -e .
ENV HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 THINKPOOL_IMAGE_DEVICE=${DEVICE}
ENTRYPOINT ["thinkpool"]
CMD ["info"]
