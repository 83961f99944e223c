# thinkpool image: CPU torch by default; build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 for GPUs.
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
WORKDIR /app
COPY pyproject.toml README.md ./
COPY orchestrator orchestrator
COPY workers workers
COPY dms_runtime dms_runtime
COPY policies policies
COPY tasks tasks
COPY configs configs
COPY checkpoints checkpoints
RUN pip install --no-cache-dir "${TORCH_SPEC}" && pip install --no-cache-dir -e .
ENV HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
ENTRYPOINT ["thinkpool"]
CMD ["info"]
