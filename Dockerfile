FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY metrale ./metrale
RUN pip install --no-cache-dir .
ENTRYPOINT []
