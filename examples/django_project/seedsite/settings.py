"""Settings of the seed-scenario example: prazo's DeadlineMiddleware first, SQLite or PostgreSQL.

``SEEDSITE_DB=sqlite`` (the default; the file is ``SEEDSITE_SQLITE_PATH`` or
``db.sqlite3`` here) or ``SEEDSITE_DB=postgresql`` (libpq's ``PGHOST``,
``PGPORT``, ``PGUSER``, ``PGDATABASE``).
"""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = "example-only-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
ROOT_URLCONF = "seedsite.urls"
WSGI_APPLICATION = "seedsite.wsgi.application"
INSTALLED_APPS = ["seedsite"]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

MIDDLEWARE = [
    # First: its deadline covers the whole stack, and its refusals are what every other middleware sees.
    "prazo.bindings.integrations.django.DeadlineMiddleware",
    "django.middleware.common.CommonMiddleware",
]
# Used only when no prazo layer set the deadline (e.g. `manage.py runserver`).
PRAZO_DEFAULT_BUDGET_MS = 1000
PRAZO_MAX_BUDGET_MS = 30000

if os.environ.get("SEEDSITE_DB", "sqlite") == "postgresql":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": os.environ.get("PGDATABASE", "postgres"),
            "USER": os.environ.get("PGUSER", "postgres"),
            "HOST": os.environ.get("PGHOST", "127.0.0.1"),
            "PORT": os.environ.get("PGPORT", "5432"),
            # One connection per worker thread, kept between requests.
            "CONN_MAX_AGE": 60,
        }
    }
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.environ.get("SEEDSITE_SQLITE_PATH", str(BASE_DIR / "db.sqlite3")),
            # Four workers write at once: wait for SQLite's lock rather than fail.
            "OPTIONS": {"timeout": 20},
        }
    }
