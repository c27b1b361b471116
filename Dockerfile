FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY api api
COPY trainer trainer
COPY rlrun rlrun
COPY migrations migrations
COPY examples examples
RUN pip install --no-cache-dir -e '.[sinks]'
ENV RLRUN_HOME=/data
EXPOSE 8000
CMD ["rlrun", "serve", "--host", "0.0.0.0"]
