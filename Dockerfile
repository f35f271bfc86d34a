# One image for every service of docker-compose.yml: migrations, worker, beat, the
# dashboard and the fake provider. The project installs from pyproject.toml like everywhere else.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md celeryconfig.py ./
COPY budget_tasks ./budget_tasks
# the reference app: `celery -A workers.app` from /app (budget_tasks/reference links it)
COPY workers ./workers
RUN pip install ".[openai,anthropic,dashboard]"
RUN useradd --create-home app
USER app
ENV BUDGET_TASKS_HOME=/home/app/.budget-tasks
